"""A megatrain checkpoint directory read as a standard single-file Lightning checkpoint (what the default
strategy saves), for models whose state fits in RAM: ``open_checkpoint`` in memory, ``convert_checkpoint``
to a file.
"""

from __future__ import annotations

import io
import math
import os
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from megatrain_lightning.optim import codecs
from megatrain_lightning.optim import state_dict as adam_state
from megatrain_lightning.optim.adamw import COMPRESSIONS
from megatrain_lightning.serialization.checkpoint import MEGATRAIN_KEYS, optimizer_block
from megatrain_lightning.serialization.checkpoint_dir import CheckpointDir, CheckpointError
from megatrain_lightning.serialization.safetensors_io import read_tensor
from megatrain_lightning.store.preflight import available_ram_bytes
from megatrain_lightning.telemetry.progress import byte_progress, finish


def open_checkpoint(path: str | os.PathLike) -> io.BytesIO:
    """A megatrain checkpoint directory as an in-memory standard Lightning checkpoint (what the default
    strategy saves), for everything that reads one::

        MyModule.load_from_checkpoint(megatrain_lightning.open_checkpoint(path))
        torch.load(megatrain_lightning.open_checkpoint(path), weights_only=True)

    The model and optimizer state must fit in RAM twice (the dict and its serialized bytes); otherwise
    use :func:`convert_checkpoint`, or ``megatrain export`` for the weights alone. A single-file
    checkpoint (the default strategy's) is read as it is, so the same line serves both."""
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return io.BytesIO(f.read())
    buffer = io.BytesIO()
    torch.save(to_lightning(path, copies=2), buffer)
    buffer.seek(0)
    return buffer


def convert_checkpoint(path: str | os.PathLike, out: str | os.PathLike) -> None:
    """Write a megatrain checkpoint directory as a standard single-file ``.ckpt`` at ``out`` (written
    under a temporary name, then renamed), which any strategy resumes with ``fit(ckpt_path=out)``.
    ``megatrain convert CKPT OUT`` does the same from the shell. An existing ``out`` is left as it is."""
    out = os.fspath(out)
    if os.path.isdir(out):
        raise CheckpointError(f"{out} is a directory; name the single checkpoint file to write.")
    if os.path.lexists(out):
        raise FileExistsError(f"megatrain: {out} exists; nothing was written. Name a new file, or remove it.")
    state = to_lightning(path, copies=1)
    tmp = f"{out}.tmp-{os.getpid()}"
    nbytes = sum(t.nbytes for t in tree_flatten(state)[0] if isinstance(t, Tensor))
    try:
        with open(tmp, "wb") as f, byte_progress(nbytes, f"writing {out}") as progress:
            torch.save(state, _Counted(f, progress))
            f.flush()
            os.fsync(f.fileno())
            finish(progress)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class _Counted:
    """A file that moves a progress bar by the bytes written through it (``torch.save`` only writes)."""

    def __init__(self, file: Any, progress: Any) -> None:
        self._file, self._progress = file, progress

    def write(self, data: bytes) -> int:
        written = self._file.write(data)
        self._progress.update(written)
        return written

    def flush(self) -> None:
        self._file.flush()


def to_lightning(path: str | os.PathLike, copies: int = 1) -> dict[str, Any]:
    """The checkpoint as the dict the default strategy saves: ``state_dict`` with every key of the module's
    own (fp32; a tied weight under each of its names, sharing storage), ``optimizer_states`` in
    ``torch.optim.AdamW``'s format (compressed moments decoded to fp32), and the rest of Lightning's state
    as saved. Everything is read into RAM: ``copies`` times the state must fit there."""
    ckpt = CheckpointDir.verify(path)
    if "layout" not in ckpt.manifest:
        raise CheckpointError(
            f"{ckpt.path} was written by an older megatrain that did not record what a single-file "
            "checkpoint needs; resume it under megatrain and save it again."
        )
    _check_fits_in_ram(ckpt, copies)
    state = ckpt.lightning_state()
    for key in MEGATRAIN_KEYS:
        state.pop(key, None)
    state["state_dict"] = ckpt.state_dict(read_tensor)
    if state.get("optimizer_states") and "optimizer" in ckpt.manifest:
        state["optimizer_states"][0]["state"] = _adam_state(ckpt)
    return state


def _check_fits_in_ram(ckpt: CheckpointDir, copies: int) -> None:
    weights = sum(info["bytes"] for name, info in ckpt.manifest["files"].items() if name.startswith("model/"))
    need = copies * weights * (3 if "optimizer" in ckpt.manifest else 1)  # fp32 weights, Adam m and v
    available = available_ram_bytes()
    if need > available:
        raise CheckpointError(
            f"Reading {ckpt.path} as a single-file checkpoint needs about {need / 1e9:.2f} GB of RAM, but "
            f"{available / 1e9:.2f} GB are available. Resume it under megatrain (`fit(ckpt_path=...)` with "
            "`strategy='megatrain'`), or export its weights with `megatrain export` (one tensor at a time)."
        )


def _adam_state(ckpt: CheckpointDir) -> dict[int, dict[str, Tensor]]:
    """The per-block flat moments as ``torch.optim.AdamW``'s per-parameter state, numbered in param-group
    order; parameters never stepped have no state, as in torch."""
    info = ckpt.manifest["optimizer"]
    bits = COMPRESSIONS[info["compression"]]
    version = codecs.FORMAT_VERSION
    if bits:
        version = adam_state.check_codec(info["compression"], info.get("codec") or {**info, "version": 1})
    number = {name: i for i, name in enumerate(info["params"])}
    entries = ckpt.optimizer().entries
    state: dict[int, dict[str, Tensor]] = {}
    for block, (params, layout) in enumerate(
        zip(ckpt.manifest["blocks"], ckpt.manifest["layout"], strict=True)
    ):
        saved = adam_state.upgraded(optimizer_block(entries, block), version)
        m, v = saved["exp_avg"], saved["exp_avg_sq"]
        quantized = layout["numel"] - m.numel()  # elements [0, quantized) have block-quantized moments
        if quantized:
            m = torch.cat([codecs.dequantize(saved["m_codes"], saved["m_scales"], "m", bits, quantized), m])
            v = torch.cat([codecs.dequantize(saved["v_codes"], saved["v_scales"], "v", bits, quantized), v])
        steps = saved["step"].tolist()
        for index, ((name, shape), offset) in enumerate(zip(params, layout["offsets"], strict=True)):
            if name not in number or steps[index] == 0:
                continue
            end = offset + math.prod(shape)
            state[number[name]] = {
                "step": torch.tensor(float(steps[index])),
                "exp_avg": m[offset:end].view(shape).clone(),
                "exp_avg_sq": v[offset:end].view(shape).clone(),
            }
    return dict(sorted(state.items()))
