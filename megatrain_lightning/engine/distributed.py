"""Data parallel over ``torch.distributed``: every rank holds 1/world of each block (ZeRO-3 over the store).

A block's flat buffers (weights, gradient sums, Adam moments) are cut into ``world`` equal shards, each
padded to whole ``ALIGN``s; rank ``r`` owns block elements ``[r * size, (r + 1) * size)`` and its store
holds only that shard (and of compressed moments the codes and scales those elements own: a share starts
on a quantization block's boundary), so adding ranks divides the store. The pieces keep the single-rank
interfaces:

- :class:`ShardedHostStore`, :class:`ShardedDiskStore` (the disk tier, in a folder per rank): ``spans`` are
  the rank's own chunks, so everything that works chunk by chunk (gradient sums, the optimizer's update,
  the disk tier's cache and files) touches only the shard, unchanged. A whole-block read (a forward's
  weights, ``state_dict``) is an ``all_gather_into_tensor`` of the shards; a whole-block write (adopting
  weights) takes rank 0's block and keeps the own shard; loading a checkpoint writes each rank's own share
  alone (``rewriting`` with a ``span``).
- :class:`~.gathers.GatheredBlocks`: the pager of a sharded engine: each use of a block gathers it, in the
  compute dtype, started ahead along the trace.
- :class:`ShardedGrads`: a call's gradients are ``reduce_scatter``ed (sum, then the mean Lightning's DDP
  gives) on the exchange device and each rank adds its shard to its host sums. In micro-batches that only
  accumulate they are summed locally in full on the host, without communication, and reduced once with the
  stepping micro-batch's.

Every collective is issued by the thread running the pass (the compute thread; in a GPU's backward
autograd's, while the compute thread waits for it), in the order the model's forward and backward visit
blocks, which is the same on every rank: a rank never reorders them by timing (block updates and disk I/O
in other threads touch only the own shard, and a gather waits for the shard's update). Host tensors go to
gloo; on CUDA the default group also carries NCCL for device tensors (``cpu:gloo,cuda:nccl``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatrain_lightning.engine.grads import HostGrads
from megatrain_lightning.store.disk import DiskStore
from megatrain_lightning.store.host import HostStore
from megatrain_lightning.store.layout import Block, align_up, chunk_spans
from megatrain_lightning.telemetry.stats import EngineStats

# ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` are deprecated in favour of the ``_single``
# collectives where those exist.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Shard:
    """This rank's place among ``world`` ranks (the default process group), and where the ranks exchange
    blocks' weights and gradients: the GPU where NCCL carries device tensors, else the host (gloo)."""

    rank: int
    world: int
    device: torch.device = torch.device("cpu")

    def size(self, block: Block) -> int:
        """Elements each rank holds of ``block``: an equal share, padded to whole ``ALIGN``s."""
        return align_up(-(-block.numel // self.world))

    def owned(self, block: Block) -> tuple[int, int]:
        """The block elements this rank owns (padding excluded; empty for a rank past a small block's end)."""
        start = self.rank * self.size(block)
        return min(start, block.numel), min(start + self.size(block), block.numel)


_SAME_SIZE_INT = {8: torch.int64, 4: torch.int32}  # itemsize -> an integer dtype to sum bits in


class _ShardedStore:
    """Mixed in before a store class (host or disk tier): that store then holds this rank's shard of every
    block's buffers (see the module docstring)."""

    shard: Shard
    blocks: list[Block]
    chunk_numel: int
    stats: EngineStats

    def layout(self, block: int, kind: str) -> tuple[torch.dtype, int]:
        """``kind``'s dtype and the elements of it this rank's share of ``block`` owns (for compressed
        moments, their codes and scales: a share starts on a quantization block's boundary)."""
        dtype, _ = self.block_layout(block, kind)
        start, stop = self.block_kind_span(block, kind, self._share(block))
        return dtype, stop - start

    def spans(self, block: int) -> list[tuple[int, int]]:
        """This rank's chunks of ``block`` (none when it owns nothing of a small block)."""
        lo, hi = self.shard.owned(self.blocks[block])
        return [(lo + a, lo + b) for a, b in chunk_spans(hi - lo, self.chunk_numel)] if hi > lo else []

    def kind_span(self, block: int, kind: str, span: tuple[int, int] | None) -> tuple[int, int]:
        if span is None:
            return 0, self.layout(block, kind)[1]
        share = self._share(block)
        if not share[0] <= span[0] <= span[1] <= share[1]:
            raise RuntimeError(
                f"megatrain: elements {span} of block {block} are not on rank {self.shard.rank}"
            )
        base = self.block_kind_span(block, kind, (share[0], share[0]))[0]
        start, stop = self.block_kind_span(block, kind, span)
        return start - base, stop - base

    def _share(self, block: int, rank: int | None = None) -> tuple[int, int]:
        """The elements of ``block`` that a rank (this one by default) holds, its padding included."""
        size = self.shard.size(self.blocks[block])
        rank = self.shard.rank if rank is None else rank
        return rank * size, (rank + 1) * size

    @contextlib.contextmanager
    def pinned(
        self, block: int, kind: str, write: bool = False, span: tuple[int, int] | None = None
    ) -> Iterator[Tensor]:
        """With ``span`` (of the own shard): that part of it. Without: the whole block, gathered (collective
        like a full ``state_dict`` under FSDP: every rank reads, as Lightning's hooks do, and every rank
        writes, as loading a checkpoint does)."""
        if span is not None:
            with super().pinned(block, kind, write, span) as flat:
                yield flat
        elif write:
            with self._whole_block(block, kind) as full:
                yield full
        else:
            yield self.read(block, kind)

    def read(self, block: int, kind: str) -> Tensor:
        """The whole block's ``kind``, gathered from every rank's shard (a fresh buffer; collective)."""
        self.wait_for_change(block)
        return self._gather_ranks(block, kind)[: self.block_layout(block, kind)[1]]

    @contextlib.contextmanager
    def rewriting(
        self, block: int, kind: str = "param", span: tuple[int, int] | None = None
    ) -> Iterator[Tensor]:
        """``pinned(write=True)`` for a change made in this thread: of the own elements ``span``, on this
        rank alone (loading its share of a checkpoint), or of the whole block (collective: adopting
        weights)."""
        if span is not None:
            with super().rewriting(block, kind, span) as own:
                yield own
            return
        self.wait_for_change(block)
        self.will_change(block)
        with self._whole_block(block, kind) as full:
            yield full
        self.written(block, [kind])

    @contextlib.contextmanager
    def _whole_block(self, block: int, kind: str) -> Iterator[Tensor]:
        """The whole block to change in place (collective): it starts as gathered; what rank 0 leaves in
        it becomes every rank's, each keeping its shard (the ranks' models might differ, rank 0's wins)."""
        full = self._gather_ranks(block, kind)
        yield full[: self.block_layout(block, kind)[1]]
        dist.broadcast(full, src=0)
        lo, hi = self.shard.owned(self.blocks[block])
        if hi > lo:
            start, stop = self.block_kind_span(block, kind, (lo, hi))
            with super().pinned(block, kind, write=True, span=(lo, hi)) as own:
                own.copy_(full[start:stop])

    def read_span(self, block: int, kind: str, span: tuple[int, int]) -> Tensor:
        """Block elements ``span`` of ``kind``, summed from the ranks' own parts and zeros elsewhere
        (collective, as ``read``: e.g. the ``param.grad`` every rank reads in Lightning's ``zero_grad``):
        a parameter's read moves its own size, not its block's. The sum is of the values' bits as integers:
        each element has one owner, so it is that owner's value exactly (a float sum would turn -0.0 into
        +0.0)."""
        self.wait_for_change(block)
        lo, hi = self.shard.owned(self.blocks[block])
        start, stop = max(span[0], lo), min(span[1], hi)
        part = torch.zeros(span[1] - span[0], dtype=self.layout(block, kind)[0])
        if start < stop:
            with super().pinned(block, kind, span=(start, stop)) as own:
                part[start - span[0] : stop - span[0]] = own
        dist.all_reduce(part.view(_SAME_SIZE_INT.get(part.dtype.itemsize, part.dtype)))
        return part

    def write_span(self, block: int, kind: str, span: tuple[int, int], values: Tensor) -> None:
        """Block elements ``span`` set to ``values`` on every rank, as each rank's user code sets them: each
        keeps the part it owns (no collective). The block changes on every rank alike, owner or not: each
        drops its gathered copies of it."""
        lo, hi = self.shard.owned(self.blocks[block])
        start, stop = max(span[0], lo), min(span[1], hi)
        if start < stop:
            own = values.reshape(-1)[start - span[0] : stop - span[0]]
            super().write_span(block, kind, (start, stop), own)
        else:
            self.wait_for_change(block)
            self.will_change(block)

    def _gather_ranks(self, block: int, kind: str) -> Tensor:
        """Every rank's share of ``block``'s ``kind`` in rank order, the weights' padding included (shares
        of compressed moments differ in size: each is sent padded to the largest)."""
        dtype, _ = self.block_layout(block, kind)
        sizes = [self._kind_size(block, kind, rank) for rank in range(self.shard.world)]
        lo, hi = self.shard.owned(self.blocks[block])
        mine = torch.zeros(max(sizes), dtype=dtype)
        if hi > lo:
            with super().pinned(block, kind, span=(lo, hi)) as own:
                mine[: own.numel()] = own
        width = max(sizes)
        full = torch.empty(width * self.shard.world, dtype=dtype)
        all_gather(full, mine)
        self.stats.add(gathered_bytes=full.nbytes - mine.nbytes)
        if len(set(sizes)) == 1:
            return full
        return torch.cat([full[rank * width : rank * width + size] for rank, size in enumerate(sizes)])

    def _kind_size(self, block: int, kind: str, rank: int) -> int:
        start, stop = self.block_kind_span(block, kind, self._share(block, rank))
        return stop - start


class ShardedHostStore(_ShardedStore, HostStore):
    """The host tier's share of one rank."""

    def __init__(self, shard: Shard, blocks: list[Block], stats: EngineStats, chunk_numel: int) -> None:
        self.shard = shard
        super().__init__(blocks, pin_memory=False, stats=stats, chunk_numel=chunk_numel)


class ShardedDiskStore(_ShardedStore, DiskStore):
    """The disk tier's share of one rank: the own chunks in files under its own folder, cached in RAM."""

    def __init__(
        self, shard: Shard, blocks: list[Block], offload_dir: str, cache_bytes: int, **kwargs: Any
    ) -> None:
        self.shard = shard
        super().__init__(blocks, offload_dir, cache_bytes, **kwargs)

    def _chunks_in(self, block: int, span: tuple[int, int] | None) -> list[int]:
        """Chunks are counted from the own shard's start."""
        if span is None or not self._chunks[block]:
            return super()._chunks_in(block, span)
        lo = self._chunks[block][0][0]
        return super()._chunks_in(block, (span[0] - lo, span[1] - lo))


class ShardedGrads(HostGrads):
    """Gradient sums of this rank's shards. ``reduce_at_once`` (set while the optimizer's step runs its
    closure, and in manual optimization): each offload is reduce-scattered at once, as under DDP; otherwise
    gradients are summed locally in full until :meth:`reduce_local` (or the next offload while reducing)
    reduces them, as under DDP's ``no_sync`` while Lightning accumulates."""

    def __init__(
        self, store: ShardedHostStore | ShardedDiskStore, device: torch.device, stats: EngineStats
    ) -> None:
        super().__init__(store, device, stats, asynchronous=False)
        self.shard = store.shard
        self.reduce_at_once = False
        self._local: dict[int, tuple[Tensor, set[int]]] = {}  # block -> (full local sum, its indices)

    def offload(self, block: int, grads: dict[int, Tensor], final: bool, then: Callable[[], None]) -> None:
        """Add ``grads`` to the block's full local sum: on the exchange device when it is reduced now, else on
        the host (where it waits for the stepping micro-batch)."""
        device = self.shard.device if self.reduce_at_once else torch.device("cpu")
        local = self._local.pop(block, None)
        flat, present = (local[0].to(device), local[1]) if local else (self._padded(block, device), set())
        params = self.store.blocks[block].params
        for index, grad in grads.items():
            part = flat[params[index].offset : params[index].offset + params[index].numel]
            self._add_into(part, grad.reshape(-1).to(device), index in present)
        present.update(grads)
        if not self.reduce_at_once:
            self._local[block] = (flat, present)
            then()
            return
        super().offload(block, self._reduce(block, flat, present), final, then)

    def reduce_local(self) -> None:
        """Reduce every block's local sums (of micro-batches that only accumulated, or a manual backward)
        into the shards; collective, in block order (a block only one rank has sums of included)."""
        pending = torch.zeros(len(self.store.blocks), dtype=torch.int32)
        pending[list(self._local)] = 1
        dist.all_reduce(pending, op=dist.ReduceOp.MAX)
        for block in pending.nonzero().flatten().tolist():
            local = self._local.pop(block, None)
            flat, present = local or (self._padded(block, self.shard.device), set())
            super().offload(block, self._reduce(block, flat.to(self.shard.device), present), True, _nothing)

    def clear(self) -> None:
        try:
            super().clear()
        finally:
            self._local.clear()

    def assign(self, block: int, index: int, value: Tensor | None) -> None:
        """As :meth:`HostGrads.assign`, the local sum not reduced yet included: it is gone too."""
        super().assign(block, index, value)
        local = self._local.get(block)
        if local is not None and index in local[1]:
            spec = self.store.blocks[block].params[index]
            # Zeroed, not only forgotten: the whole local sum is reduce-scattered with the other ranks'.
            local[0][spec.offset : spec.offset + spec.numel].zero_()
            local[1].discard(index)

    def squared_norm(self, clamp: float | None) -> Tensor:
        """Sum of squares (fp64) of this rank's gradient shards, after clamping them to ``±clamp``."""
        self.ready()
        total = torch.zeros((), dtype=torch.float64)
        for block in range(len(self.store.blocks)):
            present = self.present(block)
            for span in self.store.spans(block):
                with self.store.pinned(block, "grad", write=clamp is not None, span=span) as flat:
                    for _, a, b, _ in self._parts(block, span, present):
                        part = flat[a - span[0] : b - span[0]]
                        if clamp is not None:
                            part.clamp_(-clamp, clamp)
                        total += part.double().square().sum()
        return total

    def _padded(self, block: int, device: torch.device) -> Tensor:
        numel = self.shard.size(self.store.blocks[block]) * self.shard.world
        return torch.zeros(numel, dtype=torch.float32, device=device)  # not the default dtype (bf16-true's)

    def _reduce(self, block: int, flat: Tensor, present: set[int]) -> dict[int, Tensor]:
        """Reduce-scatter ``flat`` (this rank's full sum of ``block``, on the exchange device) into the mean
        over ranks, written into the own shard's place of a host buffer of the block's size; returns its views
        of every parameter some rank has a gradient of (only their own parts hold the mean, and are written:
        the store adds no other)."""
        spec = self.store.blocks[block]
        mask = torch.zeros(len(spec.params), dtype=torch.int32)
        mask[list(present)] = 1
        dist.all_reduce(mask, op=dist.ReduceOp.MAX)
        size = self.shard.size(spec)
        mine = torch.empty(size, dtype=torch.float32, device=flat.device)
        _reduce_scatter(mine, flat, op=dist.ReduceOp.SUM)
        self.stats.add(reduce_scattered_bytes=flat.nbytes - mine.nbytes)
        on_host = flat if flat.device.type == "cpu" else torch.empty(flat.numel(), dtype=torch.float32)
        base = self.shard.rank * size
        on_host[base : base + size] = mine.div_(self.shard.world)
        return {
            i: on_host[spec.params[i].offset : spec.params[i].offset + spec.params[i].numel].view(
                spec.params[i].shape
            )
            for i in mask.nonzero().flatten().tolist()
        }


def _nothing() -> None:
    return None
