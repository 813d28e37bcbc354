"""CPUAdamW's state in torch's format, and per block for checkpoints (one block in memory at a time).

Uncompressed, ``save`` gives ``torch.optim.AdamW``'s ``state_dict`` (views of the store) and ``load``
takes one; compressed, the moments are saved as stored (codes and scales per block) with the codec
they were stored by (``"codec"``: compression and ``codecs.FORMAT_VERSION``), which ``load`` checks, and
converts where an older version can be (``upgraded``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from megatrain_lightning.optim import codecs
from megatrain_lightning.store.host import HostStore
from megatrain_lightning.store.layout import Block

if TYPE_CHECKING:
    from megatrain_lightning.optim.adamw import CPUAdamW

FP32_MOMENTS = ("exp_avg", "exp_avg_sq")  # every block without compression; small parameters with it


def block_state(optimizer: CPUAdamW, block: int) -> dict[str, Tensor]:
    """``block``'s optimizer state as flat tensors: each state buffer and per-parameter step counts."""
    optimizer.wait(block)
    state = {kind: optimizer.store.read(block, kind) for kind in optimizer.state_kinds}
    state["step"] = torch.tensor(optimizer.steps[block], dtype=torch.int64)
    return state


def load_block_state(
    optimizer: CPUAdamW, block: int, tensors: dict[str, Tensor], span: tuple[int, int] | None = None
) -> None:
    """``block``'s state from ``tensors``: of the whole block, or of its elements ``span`` (one rank's
    share of a data-parallel store, which may be empty)."""
    optimizer.wait(block)
    if span is None or span[0] < span[1]:
        for kind in optimizer.state_kinds:
            with optimizer.store.pinned(block, kind, write=True, span=span) as flat:
                if tensors[kind].shape != flat.shape or tensors[kind].dtype != flat.dtype:
                    raise ValueError(
                        f"megatrain: saved optimizer state {kind!r} of block {block} has another layout"
                    )
                flat.copy_(tensors[kind])
        optimizer.store.written(block, optimizer.state_kinds, span)
    optimizer.steps[block] = tensors["step"].tolist()


def load_param_groups(optimizer: CPUAdamW, groups: list[dict[str, Any]]) -> None:
    """Hyperparameters (lr, betas, ...) of saved param groups; the parameters stay this optimizer's."""
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        raise ValueError("megatrain: the optimizer state does not match this model's param groups")
    for group, saved in zip(optimizer.param_groups, groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})


def save(optimizer: CPUAdamW) -> dict[str, Any]:
    """torch.optim.AdamW's format; with compression, the compressed blocks as stored."""
    optimizer.wait_all()
    if optimizer.bits:
        blocks = {b: block_state(optimizer, b) for b in range(len(optimizer.store.blocks))}
        return {
            "state": {},
            "param_groups": param_groups_state(optimizer),
            "blocks": blocks,
            "codec": codec_info(optimizer.compression),
        }
    state: dict[int, dict[str, Tensor]] = {}
    views: dict[int, list[list[Tensor]]] = {}
    for i, (block, index) in enumerate(optimizer.order):
        step = optimizer.steps[block][index]
        if step == 0:
            continue
        if block not in views:
            views[block] = [
                optimizer.store.blocks[block].views(optimizer.store.read(block, kind))
                for kind in FP32_MOMENTS
            ]
        m, v = (kind_views[index] for kind_views in views[block])
        state[i] = {"step": torch.tensor(float(step)), "exp_avg": m, "exp_avg_sq": v}
    return {"state": state, "param_groups": param_groups_state(optimizer)}


def param_groups_state(optimizer: CPUAdamW) -> list[dict[str, Any]]:
    """The param groups as ``torch.optim`` saves them: hyperparameters, parameters by number."""
    groups, start = [], 0
    for group in optimizer.param_groups:
        entry = {k: v for k, v in group.items() if k != "params"}
        entry["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        groups.append(entry)
    return groups


def load(optimizer: CPUAdamW, state_dict: dict[str, Any]) -> None:
    optimizer.wait_all()
    load_param_groups(optimizer, state_dict["param_groups"])
    if optimizer.bits or "blocks" in state_dict:
        if optimizer.bits is None or "blocks" not in state_dict:
            raise ValueError("megatrain: optimizer state saved with another `optimizer_compression`")
        version = check_codec(optimizer.compression, state_dict.get("codec"))
        for block, tensors in state_dict["blocks"].items():
            load_block_state(optimizer, int(block), upgraded(tensors, version))
        return
    for i, (block, index) in enumerate(optimizer.order):
        saved = state_dict["state"].get(i, state_dict["state"].get(str(i)))
        if saved is None:
            optimizer.steps[block][index] = 0
            continue
        optimizer.steps[block][index] = int(saved["step"])
        for kind in FP32_MOMENTS:
            with optimizer.store.pinned(block, kind, write=True) as flat:
                optimizer.store.blocks[block].views(flat)[index].copy_(saved[kind])


def codec_info(compression: str) -> dict[str, Any]:
    """What compressed moments must be read with: the compression and the codecs' format version."""
    return {"compression": compression, "version": codecs.FORMAT_VERSION}


_INT8_LINEAR_V = (1, 2)  # format versions whose int8 v has a linear map


def check_codec(compression: str, saved: dict[str, Any] | None) -> int:
    """The format version of compressed moments stored by ``compression``'s codec, refusing another
    compression's and versions that cannot be read. State saved before the codec was recorded (version 1)
    is int8's format or issue 4's int4 (blocks of 128, linear v map); int8's v changed from a linear to a
    log map in version 3 and is converted (``upgraded``), older int4 state is refused."""
    saved = saved or {"compression": compression, "version": 1}
    if saved["compression"] != compression:
        raise ValueError(
            "megatrain: the optimizer state was saved with "
            f"`optimizer_compression={saved['compression']!r}`; resume it with that setting (this run uses "
            f"{compression!r}), or, to change it, convert the checkpoint to one file with the moments in "
            "fp32 (`megatrain convert CHECKPOINT OUT.ckpt`) and resume from that."
        )
    version = saved["version"]
    if version != codecs.FORMAT_VERSION and not (compression == "int8" and version in _INT8_LINEAR_V):
        raise ValueError(
            f"megatrain: this {compression} optimizer state was stored in {compression} format version "
            f"{version}, which changed in version {codecs.FORMAT_VERSION} (see optim/codecs.py); "
            "resume it with the megatrain that wrote it, or train on from its weights with a fresh optimizer."
        )
    return version


def upgraded(tensors: dict[str, Tensor], version: int) -> dict[str, Tensor]:
    """A block's compressed state (or a rank's share of it) stored in format ``version`` (accepted by
    ``check_codec``), in today's: int8's linear v of versions 1 and 2 re-encoded in the log map."""
    if version == codecs.FORMAT_VERSION:
        return tensors
    v_codes, v_scales = codecs.upgrade_v8(tensors["v_codes"], tensors["v_scales"])
    return {**tensors, "v_codes": v_codes, "v_scales": v_scales}


def define_kinds(store: HostStore, quantized: list[int], bits: int | None) -> None:
    """The store kinds holding the moments: fp32 ``exp_avg``/``exp_avg_sq`` past each block's quantized
    region (``quantized[block]`` elements), and with ``bits`` the codes and scales before it; each with the
    part of it that a range of the block's elements owns (the store's chunks)."""

    def fp32_span(b: Block, start: int, stop: int) -> tuple[int, int]:
        q = quantized[b.index]
        return max(start, q) - q, max(stop, q) - q

    def quantized_span(which: int) -> Callable[[Block, int, int], tuple[int, int]]:
        def span(b: Block, start: int, stop: int) -> tuple[int, int]:
            q = quantized[b.index]
            where = codecs.state_slices(min(start, q), min(stop, q), bits)[which]
            return where.start, where.stop

        return span

    for kind in FP32_MOMENTS:
        store.define_kind(kind, torch.float32, lambda b: b.numel - quantized[b.index], fp32_span)
    if bits:
        sizes = {"codes": (torch.uint8, codecs.code_bytes), "scales": (torch.float32, codecs.num_scales)}
        for which, kind in enumerate(("m_codes", "m_scales", "v_codes", "v_scales")):  # state_slices' order
            moment, part = kind.split("_")
            dtype, size = sizes[part]
            numel = lambda b, m=moment, size=size: size(quantized[b.index], m, bits)  # noqa: E731
            store.define_kind(kind, dtype, numel, quantized_span(which))
