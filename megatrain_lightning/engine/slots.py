"""What a block looks like on the device: each parameter's compute dtype, its place in a slot, and how
many slots of which sizes a device budget buys.

This is the one place that decides a parameter's dtype on the device (a host-side copy in the compute
dtype must follow :func:`param_dtype` too). Under ``"bf16-mixed"`` Lightning keeps fp32 weights and
lets autocast cast them for the ops it lists (matmuls, convolutions). A weight that only such an op
reads may sit in the slot in bf16, rounded as autocast would round it: the weight of an ``nn.Linear``,
an ``nn.Conv*d`` or Hugging Face's ``Conv1D`` whose forward is the stock one. Every other parameter
stays fp32, as Lightning's: embeddings (the lookup is on no autocast list: an fp32 table keeps the
residual stream fp32), norm weights and biases (elementwise ops that autocast leaves in fp32), and
parameters that models read in their own ways (mixture-of-experts weights fed to grouped matmuls or
upcast with ``.float()``, state-space ``A_log``, ...). Their values and gradients are then fp32 too.

A slot is a byte buffer. A block fills it with *runs*: stretches of its flat store layout whose
parameters share a dtype, each copied in one transfer; with one dtype (``"32-true"``, ``"bf16-true"``)
a block is one run and the slot is its flat layout in that dtype.

Slots come in pools, one per block size on the device (:func:`slot_pools`): a decoder layer's slot is a
layer's size, and a large embedding or head does not set the size of every slot. A block fits any slot
at least its size. The engine and the planner size the pools with the same function.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from megatrain_lightning.store.host import Runs, shadow_index
from megatrain_lightning.store.layout import ALIGN, Block

RUN_ALIGN = ALIGN * 4  # bytes: every run starts ALIGN fp32 elements into the slot
OVERLAP = 2  # blocks on the device at once so that one computes while the next one loads
_AUTOCAST_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)  # forward: one op autocast casts for


def _autocast_weight(owner: nn.Module, attr: str) -> bool:
    """Whether ``owner.<attr>`` is a weight its module's stock forward hands to an op autocast casts for."""
    if attr != "weight":
        return False
    if any(type(owner).forward is cls.forward for cls in _AUTOCAST_MODULES if isinstance(owner, cls)):
        return True
    return type(owner).__name__ == "Conv1D" and type(owner).__module__ == "transformers.pytorch_utils"


def param_dtype(block: Block, index: int, compute_dtype: torch.dtype, mixed: bool) -> torch.dtype:
    """The dtype of ``block``'s parameter ``index`` on the device; ``mixed``: autocast (``bf16-mixed``)."""
    if not mixed or compute_dtype == torch.float32:
        return compute_dtype
    owners = [b for site in block.sites for b in site.bindings if b.index == index]
    return compute_dtype if all(_autocast_weight(b.owner, b.attr) for b in owners) else torch.float32


def mixed_fp32_numels(blocks: list[Block]) -> list[int]:
    """Per block, the elements (padding included) that stay fp32 on the device under ``bf16-mixed``: the
    planner sizes slots with them."""
    layout = SlotLayout(blocks, torch.bfloat16, mixed=True)
    return [sum(r.end - r.start for r in runs if r.dtype == torch.float32) for runs in layout.runs]


Pools = tuple[tuple[int, int], ...]  # (slot bytes, number of slots) per size, largest first


def slot_pools(block_bytes: Sequence[int], budget: float | None = None) -> Pools:
    """The device slots ``budget`` bytes buy for blocks of ``block_bytes`` each (a block fits any slot at
    least its size); none when the budget is below the largest block.

    ``None``, or a budget that holds every block: a slot per block, so every block stays resident (copied
    again only once its weights are updated). Otherwise the ``OVERLAP`` largest blocks get a slot each
    (one computes while the next one loads, whatever their sizes), then each next slot goes to the size
    whose blocks have the smallest share of slots (the larger size on a tie), as long as the budget left
    holds it.
    """
    sizes = collections.Counter(block_bytes)
    if budget is None or budget >= sum(block_bytes):
        return tuple(sorted(sizes.items(), reverse=True))
    if budget < max(block_bytes, default=0):
        return ()
    counts, left = dict.fromkeys(sizes, 0), budget
    largest = sorted(block_bytes, reverse=True)[:OVERLAP]
    firsts = [(size, largest[:i].count(size)) for i, size in enumerate(largest)]  # (size, k-th of it)
    shares = sorted((k / n, -size, k) for size, n in sizes.items() for k in range(n))
    for size, k in firsts + [(-size, k) for _, size, k in shares]:
        if counts[size] <= k and size <= left:
            counts[size] += 1
            left -= size
    return tuple((size, n) for size, n in sorted(counts.items(), reverse=True) if n)


def serial_blocks(block_bytes: Sequence[int], pools: Pools) -> int:
    """How many blocks fit fewer than ``OVERLAP`` of ``pools``' slots: each of them loads only once the
    block before it has finished computing (nothing can be fetched ahead into the one slot it fits)."""
    fits = {size: sum(n for slot, n in pools if slot >= size) for size in set(block_bytes)}
    return sum(1 for size in block_bytes if fits[size] < OVERLAP)


@dataclass(frozen=True)
class Run:
    """Store elements ``[start, end)`` of a block, on the device in ``dtype`` from byte ``offset``."""

    start: int
    end: int
    dtype: torch.dtype
    offset: int

    @property
    def nbytes(self) -> int:
        return (self.end - self.start) * self.dtype.itemsize


class SlotLayout:
    """Every block's runs and parameter dtypes for one compute dtype; ``nbytes``: one slot's size."""

    def __init__(self, blocks: list[Block], compute_dtype: torch.dtype, mixed: bool = False) -> None:
        self.blocks = blocks
        self.compute_dtype = compute_dtype
        self.dtypes = [
            [param_dtype(block, i, compute_dtype, mixed) for i in range(len(block.params))]
            for block in blocks
        ]
        self.runs = [self._runs(block, dtypes) for block, dtypes in zip(blocks, self.dtypes, strict=True)]
        self.offsets = [[self._byte_offset(b.index, i) for i in range(len(b.params))] for b in blocks]
        self.block_bytes = [runs[-1].offset + runs[-1].nbytes if runs else 0 for runs in self.runs]
        self.nbytes = max(self.block_bytes, default=0)

    @staticmethod
    def _runs(block: Block, dtypes: list[torch.dtype]) -> list[Run]:
        """Consecutive parameters (in store order) of one dtype form a run; each run starts aligned."""
        runs: list[Run] = []
        for i in sorted(range(len(block.params)), key=lambda i: block.params[i].offset):
            if runs and runs[-1].dtype == dtypes[i]:
                continue
            start, offset = block.params[i].offset, 0
            if runs:
                last = runs[-1] = dataclasses.replace(runs[-1], end=start)
                offset = _align(last.offset + last.nbytes)
            runs.append(Run(start, block.numel, dtypes[i], offset))
        return runs

    def _byte_offset(self, block: int, index: int) -> int:
        start = self.blocks[block].params[index].offset
        run = next(r for r in reversed(self.runs[block]) if r.start <= start)
        return run.offset + (start - run.start) * run.dtype.itemsize

    def view(self, block: int, index: int, slot: Tensor) -> Tensor:
        """Parameter ``index`` of ``block`` in ``slot`` (the slot's whole byte buffer), shaped."""
        spec, dtype, start = (
            self.blocks[block].params[index],
            self.dtypes[block][index],
            self.offsets[block][index],
        )
        return slot[start : start + spec.numel * dtype.itemsize].view(dtype).view(spec.shape)

    @functools.cached_property
    def shadow_runs(self) -> list[Runs]:
        """Per block, the store elements that sit in the slot in bf16: what the host tier's shadow holds."""
        return [[(r.start, r.end) for r in runs if r.dtype != torch.float32] for runs in self.runs]

    def copy_in(
        self,
        block: int,
        src: Tensor,
        slot: Tensor,
        non_blocking: bool = False,
        span: tuple[int, int] | None = None,
        shadow: Tensor | None = None,
    ) -> int:
        """Copy ``block``'s flat master weights ``src`` (or, with ``span``, its elements ``[start, stop)``: a
        store chunk) into ``slot``, each run in its dtype: the bf16 runs from ``shadow`` (the store's bf16
        copy of the same chunk, :data:`~megatrain_lightning.store.host.SHADOW`) when given, else converted
        from ``src``. Returns the bytes read from the host."""
        lo, hi = span or (0, self.blocks[block].numel)
        origin = shadow_index(self.shadow_runs[block], lo)
        nbytes = 0
        for run in self.runs[block]:
            a, b = max(run.start, lo), min(run.end, hi)
            if a < b:
                start = run.offset + (a - run.start) * run.dtype.itemsize
                dst = slot[start : start + (b - a) * run.dtype.itemsize].view(run.dtype)
                if shadow is not None and run.dtype != torch.float32:
                    at = shadow_index(self.shadow_runs[block], a) - origin
                    part = shadow[at : at + b - a]
                else:
                    part = src[a - lo : b - lo]
                dst.copy_(part, non_blocking=non_blocking)
                nbytes += part.nbytes
        return nbytes


def _align(nbytes: int) -> int:
    return -(-nbytes // RUN_ALIGN) * RUN_ALIGN
