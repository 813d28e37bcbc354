"""Checkpoint directories: streamed from the store block by block, checksummed, written atomically.

Layout of ``<name>.ckpt/``::

    manifest.json              every file with its size and SHA-256; written last
    lightning.pt               Lightning's own state (loops, schedulers, callbacks, hyperparameters, RNG),
                               loadable with ``torch.load(weights_only=True)``
    model/block-NNNNN.safetensors      fp32 weights, named as in the LightningModule's state_dict
    model/buffers.safetensors          persistent buffers
    model/config.json                  the Hugging Face config, for ``export_hf``
    optimizer/block-NNNNN.safetensors  the optimizer's per-block state (compressed when it is)

Everything is written under ``<name>.ckpt.tmp-<pid>`` and renamed into place once complete, so
a crash leaves the previous checkpoint intact and nothing that looks complete but is not.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn

from megatrain_lightning.hf import WeightFiles
from megatrain_lightning.safetensors_io import (
    SafetensorsError,
    ShardWriter,
    read_header,
    read_into,
    sha256_file,
)

FORMAT = "megatrain-checkpoint"
MANIFEST = "manifest.json"
LIGHTNING_STATE = "lightning.pt"


class CheckpointError(MisconfigurationException):
    """A checkpoint is incomplete, corrupt or for another model; nothing was loaded."""


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))


def replace_dir(new: str, target: str) -> None:
    """Move the complete directory ``new`` to ``target``, replacing what was there."""
    if not os.path.exists(target):
        os.rename(new, target)
        return
    old = f"{target.rstrip(os.sep)}.old-{os.getpid()}"
    os.rename(target, old)
    os.rename(new, target)
    shutil.rmtree(old, ignore_errors=True)


def persistent_buffers(module: nn.Module) -> dict[str, Tensor]:
    buffers = {}
    for prefix, sub in module.named_modules():
        for name, buf in sub._buffers.items():
            if buf is not None and name not in sub._non_persistent_buffers_set:
                buffers[f"{prefix}.{name}" if prefix else name] = buf.detach().cpu()
    return buffers


def hf_model(module: nn.Module) -> tuple[str, Any] | None:
    """``(state-dict prefix, model)`` of the outermost Hugging Face model inside ``module``."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    for name, sub in module.named_modules():
        if isinstance(sub, PreTrainedModel):
            return (f"{name}." if name else ""), sub
    return None


class CheckpointWriter:
    """Collects the files of one checkpoint under a temporary name, then publishes them."""

    def __init__(self, path: str) -> None:
        self.path = os.fspath(path).rstrip(os.sep)
        self.tmp = f"{self.path}.tmp-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        for sub in ("model", "optimizer"):
            os.makedirs(os.path.join(self.tmp, sub))
        self.files: dict[str, dict[str, Any]] = {}
        self.manifest: dict[str, Any] = {"format": FORMAT, "version": 1}

    def shard(self, relpath: str, tensors: dict[str, Tensor]) -> None:
        writer = ShardWriter(
            os.path.join(self.tmp, relpath), [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
        )
        for name, tensor in tensors.items():
            writer.write(name, tensor)
        self._record(relpath, writer.close())

    def text(self, relpath: str, content: str) -> None:
        with open(os.path.join(self.tmp, relpath), "w") as f:
            f.write(content)
        self._record(relpath, sha256_file(os.path.join(self.tmp, relpath)))

    def lightning_state(self, state: dict[str, Any]) -> None:
        path = os.path.join(self.tmp, LIGHTNING_STATE)
        torch.save(state, path)
        self._record(LIGHTNING_STATE, sha256_file(path))

    def publish(self) -> None:
        self.manifest["files"] = self.files
        path = os.path.join(self.tmp, MANIFEST)
        with open(path, "w") as f:
            json.dump(self.manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        replace_dir(self.tmp, self.path)

    def _record(self, relpath: str, sha256: str) -> None:
        self.files[relpath] = {"bytes": os.path.getsize(os.path.join(self.tmp, relpath)), "sha256": sha256}


@dataclass(frozen=True)
class CheckpointDir:
    path: str
    manifest: dict[str, Any]

    @classmethod
    def verify(cls, path: str | os.PathLike) -> CheckpointDir:
        """Open a checkpoint after checking every file's size and checksum."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise CheckpointError(f"{path} is not a megatrain checkpoint directory.")
        try:
            with open(os.path.join(path, MANIFEST)) as f:
                manifest = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise CheckpointError(
                f"{path} is not a complete megatrain checkpoint ({MANIFEST}: {err})."
            ) from err
        if manifest.get("format") != FORMAT:
            raise CheckpointError(f"{path}/{MANIFEST} does not describe a megatrain checkpoint.")
        for relpath, info in manifest["files"].items():
            file = os.path.join(path, relpath)
            if not os.path.isfile(file) or os.path.getsize(file) != info["bytes"]:
                raise CheckpointError(f"{file} is missing or truncated; the checkpoint cannot be loaded.")
            if sha256_file(file) != info["sha256"]:
                raise CheckpointError(
                    f"{file} does not match its checksum (corrupt); the checkpoint cannot be loaded."
                )
        return cls(path, manifest)

    def weights(self) -> WeightFiles:
        return self._shards("model/block-")

    def optimizer(self) -> WeightFiles:
        return self._shards("optimizer/block-")

    def buffers(self) -> WeightFiles:
        return WeightFiles(self.path, read_header(os.path.join(self.path, "model", "buffers.safetensors")))

    def hf_config(self) -> str:
        if "model/config.json" not in self.manifest["files"]:
            raise CheckpointError(f"{self.path} holds no Hugging Face model, so it cannot be exported.")
        with open(os.path.join(self.path, "model", "config.json")) as f:
            return f.read()

    def lightning_state(self) -> dict[str, Any]:
        return torch.load(os.path.join(self.path, LIGHTNING_STATE), weights_only=True, map_location="cpu")

    def _shards(self, prefix: str) -> WeightFiles:
        entries = {}
        for relpath in sorted(self.manifest["files"]):
            if relpath.startswith(prefix):
                try:
                    entries.update(read_header(os.path.join(self.path, relpath)))
                except SafetensorsError as err:
                    raise CheckpointError(str(err)) from err
        return WeightFiles(self.path, entries)


def _block_file(kind: str, block: int) -> str:
    return f"{kind}/block-{block:05d}.safetensors"


def save(path: str, engine: Any, module: nn.Module, lightning_state: dict[str, Any], optimizer: Any) -> None:
    """Write a checkpoint directory, one block in memory at a time."""
    writer = CheckpointWriter(path)
    for block in engine.blocks:
        with engine.store.pinned(block.index, "param") as flat:
            names = [p.name for p in block.params]
            writer.shard(_block_file("model", block.index), dict(zip(names, block.views(flat), strict=True)))
        if optimizer is not None:
            state = optimizer.block_state(block.index)
            writer.shard(
                _block_file("optimizer", block.index), {f"{block.index}:{k}": v for k, v in state.items()}
            )
    writer.shard("model/buffers.safetensors", persistent_buffers(module))
    found = hf_model(module)
    if found is not None:
        writer.text("model/config.json", found[1].config.to_json_string())
        writer.manifest["hf_prefix"] = found[0]
    writer.manifest["blocks"] = [[[p.name, list(p.shape)] for p in b.params] for b in engine.blocks]
    writer.lightning_state(lightning_state)
    writer.publish()


def check_compatible(ckpt: CheckpointDir, engine: Any) -> None:
    """Refuse a checkpoint of another model before anything is loaded."""
    expected = [[[p.name, list(p.shape)] for p in b.params] for b in engine.blocks]
    if ckpt.manifest.get("blocks") != expected:
        raise CheckpointError(
            f"{ckpt.path} was saved from a model with other parameters or shapes than this one; load it into "
            "the model it was trained with."
        )


def load_weights(ckpt: CheckpointDir, engine: Any, module: nn.Module) -> None:
    entries = ckpt.weights().entries
    for block in engine.blocks:
        with engine.store.pinned(block.index, "param", write=True) as flat:
            for spec, view in zip(block.params, block.views(flat), strict=True):
                read_into(entries[spec.name], view)
        engine.store.written(block.index, ["param"])
        engine.pager.invalidate(block.index)
    for name, entry in ckpt.buffers().entries.items():
        buffer = module.get_buffer(name)
        value = torch.empty(entry.shape, dtype=entry.dtype)
        read_into(entry, value)
        buffer.copy_(value)


def load_optimizer(ckpt: CheckpointDir, engine: Any, optimizer: Any) -> None:
    entries = ckpt.optimizer().entries
    for block in engine.blocks:
        tensors = {}
        for name, entry in entries.items():
            if entry.path.endswith(_block_file("optimizer", block.index)):
                tensors[name.split(":", 1)[1]] = tensor = torch.empty(entry.shape, dtype=entry.dtype)
                read_into(entry, tensor)
        optimizer.load_block_state(block.index, tensors)
