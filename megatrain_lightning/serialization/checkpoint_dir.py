"""Reading a checkpoint directory (see :mod:`.checkpoint` for its layout): every file checked against the
manifest's size and SHA-256 first, then its tensors by name, a data-parallel checkpoint's per-rank pieces
put together, so that a checkpoint loads into any number of ranks, exports and converts as one."""

from __future__ import annotations

import errno
import json
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import Tensor

from megatrain_lightning.engine.chaos import point
from megatrain_lightning.serialization.hf import WeightFiles
from megatrain_lightning.serialization.publish import (
    FORMAT,
    LIGHTNING_STATE,
    MANIFEST,
    io_failure,
    is_checkpoint_dir,
    recover,
)
from megatrain_lightning.serialization.safetensors_io import (
    PiecedEntry,
    SafetensorsError,
    TensorEntry,
    read_header,
    sha256_file,
)
from megatrain_lightning.telemetry.progress import byte_progress


class CheckpointError(MisconfigurationException):
    """A checkpoint is incomplete, corrupt or for another model; nothing was loaded."""


def piece_name(name: str, first: int, whole: int) -> str:
    """A data-parallel checkpoint's name for elements ``first...`` of tensor ``name`` (``whole`` elements):
    what :meth:`CheckpointDir._assembled` reads back."""
    return f"{name}@{first}/{whole}"


def _inside(path: str) -> str:
    """A hint naming the checkpoints in a folder given instead of one (``.../checkpoints``)."""
    found = sorted(name for name in os.listdir(path) if is_checkpoint_dir(os.path.join(path, name)))
    if not found:
        return ""
    pick = "last.ckpt" if "last.ckpt" in found else found[-1]
    return f" It holds {len(found)} checkpoint(s): give one of them, e.g. {os.path.join(path, pick)}."


@dataclass(frozen=True)
class CheckpointDir:
    path: str
    manifest: dict[str, Any]

    @classmethod
    def verify(cls, path: str | os.PathLike, share: tuple[int, int] | None = None) -> CheckpointDir:
        """Open a checkpoint after checking every file's size and checksum; ``share=(rank, ranks)``: the
        checksums of every ``ranks``-th file only, from the ``rank``-th (the ranks of a data-parallel
        run divide the reading, :func:`.ranked.verify`)."""
        path = os.fspath(path)
        recover(path)
        if not os.path.isdir(path):
            raise CheckpointError(f"{path} is not a megatrain checkpoint directory.")
        try:
            with open(os.path.join(path, MANIFEST)) as f:
                manifest = json.load(f)
        except OSError as err:
            if err.errno != errno.ENOENT:
                raise io_failure(err, path, writing=False) from err
            raise CheckpointError(
                f"{path} is not a complete megatrain checkpoint ({MANIFEST}: {err}).{_inside(path)}"
            ) from err
        except json.JSONDecodeError as err:
            raise CheckpointError(
                f"{path} is not a complete megatrain checkpoint ({MANIFEST}: {err})."
            ) from err
        if manifest.get("format") != FORMAT:
            raise CheckpointError(f"{path}/{MANIFEST} does not describe a megatrain checkpoint.")
        rank, ranks = share or (0, 1)
        files = sorted(manifest["files"].items())
        for relpath, info in files:
            file = os.path.join(path, relpath)
            if not os.path.isfile(file) or os.path.getsize(file) != info["bytes"]:
                raise CheckpointError(f"{file} is missing or truncated; the checkpoint cannot be loaded.")
        mine = files[rank::ranks]
        with byte_progress(sum(info["bytes"] for _, info in mine), f"checking {path}") as progress:
            for relpath, info in mine:
                file = os.path.join(path, relpath)
                try:
                    point("ckpt.read", file)
                    digest = sha256_file(file)
                except OSError as err:
                    raise io_failure(err, path, writing=False) from err
                if digest != info["sha256"]:
                    raise CheckpointError(
                        f"{file} does not match its checksum (corrupt); the checkpoint cannot be loaded."
                    )
                progress.update(info["bytes"])
        return cls(path, manifest)

    def weights(self) -> WeightFiles:
        shapes = {name: tuple(shape) for block in self.manifest["blocks"] for name, shape in block}
        return self._shards("model/block-", shapes)

    def optimizer(self) -> WeightFiles:
        return self._shards("optimizer/block-", {})

    def buffers(self) -> WeightFiles:
        return WeightFiles(self.path, read_header(os.path.join(self.path, "model", "buffers.safetensors")))

    def hf_config(self) -> str:
        if "model/config.json" not in self.manifest["files"]:
            raise CheckpointError(f"{self.path} holds no Hugging Face model, so it cannot be exported.")
        with open(os.path.join(self.path, "model", "config.json")) as f:
            return f.read()

    def state_dict(self, read: Callable[[Any], Tensor]) -> dict[str, Tensor]:
        """Every key of the module's ``state_dict`` the checkpoint holds, each entry through ``read`` (a tied
        weight under each of its names, one tensor)."""
        weights = {name: read(entry) for name, entry in self.weights().entries.items()}
        state_dict = dict(weights)
        state_dict.update({alias: weights[name] for alias, name in self.manifest.get("aliases", {}).items()})
        state_dict.update({name: read(entry) for name, entry in self.buffers().entries.items()})
        return state_dict

    def lightning_state(self) -> dict[str, Any]:
        return torch.load(os.path.join(self.path, LIGHTNING_STATE), weights_only=True, map_location="cpu")

    def _shards(self, prefix: str, shapes: Mapping[str, tuple[int, ...]]) -> WeightFiles:
        """The tensors of the files under ``prefix``, a data-parallel checkpoint's pieces put together
        (``shapes``: those of pieced tensors that are not flat)."""
        entries = {}
        for relpath in sorted(self.manifest["files"]):
            if relpath.startswith(prefix):
                try:
                    entries.update(read_header(os.path.join(self.path, relpath)))
                except SafetensorsError as err:
                    raise CheckpointError(str(err)) from err
        return WeightFiles(self.path, self._assembled(entries, shapes))

    def _assembled(
        self, entries: dict[str, TensorEntry], shapes: Mapping[str, tuple[int, ...]]
    ) -> dict[str, Any]:
        """``entries`` with the ranks' pieces of each tensor (``<name>@<first element>/<elements of the
        whole>``) as one, after checking that they make the whole of it."""
        whole: dict[str, Any] = {}
        pieces: dict[str, list[tuple[int, int, TensorEntry]]] = {}
        for name, entry in entries.items():
            base, at, where = name.rpartition("@")
            first, _, size = where.partition("/")
            if at and first.isdigit() and size.isdigit():
                pieces.setdefault(base, []).append((int(first), int(size), entry))
            else:
                whole[name] = entry
        for name, named in pieces.items():
            parts = sorted(((first, p) for first, _, p in named if p.numel), key=lambda part: part[0])
            ends = [first + piece.numel for first, piece in parts]
            size = named[0][1]
            shape = shapes.get(name, (size,))
            if (
                [first for first, _ in parts] != [0, *ends[:-1]][: len(parts)]
                or (ends[-1] if ends else 0) != size
                or math.prod(shape) != size
                or len({(s, p.dtype) for _, s, p in named}) > 1
            ):
                raise CheckpointError(
                    f"{self.path}: the ranks' pieces of {name!r} do not make the whole tensor; the "
                    "checkpoint is incomplete and cannot be loaded."
                )
            whole[name] = PiecedEntry(named[0][2].dtype, shape, tuple(parts))
        return whole


def resume_path_of_this_run() -> Any:
    """The ``ckpt_path`` the running ``trainer.fit``/``validate``/``test``/``predict`` resolved, read from
    Lightning's ``Trainer._run`` frame: Lightning hands it to the strategy only to restore it, after the
    store is built (minutes for a large model). ``None`` where no such frame is found."""
    from lightning.pytorch.trainer.trainer import Trainer

    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not Trainer._run.__code__:
        frame = frame.f_back
    return None if frame is None else frame.f_locals.get("ckpt_path")


def missing_resume_path(path: Any) -> str | None:
    """What is wrong with a ``ckpt_path`` to resume from, said before anything is built (Lightning finds it
    missing only after the model and its store are): a local path that does not exist. Lightning's names
    (``last``, ``best``, ``hpc``, ``registry:...``) and URLs are its own to resolve."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    text = os.fspath(path)
    if (
        text in ("last", "best", "hpc")
        or text.startswith("registry")
        or "://" in text
        or os.path.exists(text)
    ):
        return None
    return (
        f"ckpt_path {text!r} does not exist (a megatrain checkpoint is a folder, such as "
        "<run>/checkpoints/last.ckpt); nothing was built."
    )
