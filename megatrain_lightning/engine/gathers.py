"""The pager of a data-parallel engine: each use of a block gathers it from the ranks' shards, ahead of time.

A block's weights are spread over the ranks (:mod:`.distributed`). For each use, every rank sends its share
in the dtypes the block computes in (under ``bf16-mixed`` its bf16 weights: what the network moves is what
the device computes on) and receives the others' in one ``all_gather`` on the *exchange device* (the GPU
where NCCL carries its tensors, else the host, gloo). The shares are laid out as the single-rank pager's
slot; where they already land in that layout (one dtype: ``32-true``, ``bf16-true``) the gathered buffer is
the slot itself. A slot lives as long as the use's views of it (the caching allocator reuses its memory).

Gathers start ahead along the trace, as the single-rank pager's copies do: acquiring a block starts the
gathers of the next ``prefetch_depth`` accesses the trace predicts (asynchronous collectives: the next
block crosses the network while this one computes). Every rank must issue the same collectives in the same
order, so gathers start only in the thread running the pass, in trace order, decided by the trace and the
store's versions (both follow the program, not timing: an update announces itself where the backward
submits it), never by what has finished. A gather never reaches past its pass: a block's update is
submitted after its last use in the pass. One that its shard's update overtook all the same (the store's
version moved on since it was sent: a prediction that failed) is dropped and the block gathered again, on
every rank alike.

On CUDA the own share is packed in page-locked memory and copied up on a side stream, and the collective
is issued there, so neither waits behind the compute stream's work; the compute stream waits for the
gather only when it needs the block (``Work.wait``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megatrain_lightning.engine.distributed import Shard, ShardedDiskStore, ShardedHostStore, all_gather
from megatrain_lightning.engine.host_views import HostViews
from megatrain_lightning.engine.slots import Run, SlotLayout
from megatrain_lightning.telemetry.stats import EngineStats

_PIECE_ALIGN = 16  # bytes: where each part of a share's slot runs starts in what the rank sends

Piece = tuple[Run, int, int, int]  # a slot run's part in one rank's share: (run, first, end, byte offset)


@dataclass
class _Gather:
    """A gather in flight: its collective, the buffer it fills and the store version of the shards sent."""

    work: dist.Work
    gathered: Tensor
    version: int


class GatheredBlocks(HostViews):
    """``acquire`` returns the block gathered from every rank (see the module docstring), on ``device``."""

    def __init__(
        self,
        store: ShardedHostStore | ShardedDiskStore,
        stats: EngineStats,
        layout: SlotLayout,
        device: torch.device,
        prefetch_depth: int,
    ) -> None:
        super().__init__(store, stats)
        self.layout = layout
        self.device = device
        self.prefetch_depth = prefetch_depth
        self.shard: Shard = store.shard
        self._pieces = [self._cut(block.index) for block in store.blocks]
        self._widths = [max(map(_packed_bytes, pieces)) for pieces in self._pieces]
        self._in_place = [self._lands_in_place(block.index) for block in store.blocks]
        self._in_flight: dict[int, _Gather] = {}
        exchange = self.shard.device
        self._copy_stream = torch.cuda.Stream(exchange) if exchange.type == "cuda" else None

    def begin_pass(self, kind: str) -> None:
        self._drop_in_flight()  # a failed prediction's gathers (none reach past their pass)
        super().begin_pass(kind)

    def close(self) -> None:
        self._drop_in_flight()

    def view(self, block: int, index: int, slot: Tensor) -> Tensor:
        return self.layout.view(block, index, slot)

    def _weights(self, block: int) -> Tensor:
        gather = self._in_flight.pop(block, None)
        if gather is not None and gather.version != self.store.version(block):
            gather.work.wait()  # sent before its shard's update: every rank drops it alike
            gather = None
        if gather is None:
            gather = self._start(block)
        try:
            for ahead, _ in self.trace.upcoming(self.prefetch_depth):
                if ahead not in self._in_flight:
                    self._in_flight[ahead] = self._start(ahead)
                    self.stats.add(gathers_ahead=1)
        finally:  # its buffer is not freed while the collective may still write it
            gather.work.wait()
        return self._slot(block, gather.gathered).to(self.device)

    def _start(self, block: int) -> _Gather:
        """Send this rank's share of ``block`` and start receiving the others' (asynchronously)."""
        version = self.store.version(block)  # before the share is read: an update announced later is newer
        mine = self._pack(block)
        exchange = self.shard.device
        gathered = torch.empty(mine.numel() * self.shard.world, dtype=torch.uint8, device=exchange)
        on_side = contextlib.nullcontext()
        if self._copy_stream is not None:  # ``gathered``'s memory may be the compute stream's until now
            self._copy_stream.wait_stream(torch.cuda.current_stream(exchange))
            on_side = torch.cuda.stream(self._copy_stream)
        with on_side:
            if exchange.type != "cpu":
                mine = mine.to(exchange, non_blocking=True)
                self.stats.add(h2d_bytes=mine.nbytes)
            work = all_gather(gathered, mine, async_op=True)
        self.stats.add(gathered_bytes=gathered.nbytes - mine.nbytes)
        return _Gather(work, gathered, version)

    def _pack(self, block: int) -> Tensor:
        """This rank's share of ``block`` in the slot's dtypes, each part where :meth:`_cut` put it (once the
        shard's pending update is done)."""
        pinned = self.shard.device.type == "cuda"
        mine = torch.zeros(self._widths[block], dtype=torch.uint8, pin_memory=pinned)
        lo, hi = self.shard.owned(self.store.blocks[block])
        if hi > lo:
            with self.store.pinned(block, "param", span=(lo, hi)) as own:
                for run, a, b, at in self._pieces[block][self.shard.rank]:
                    mine[at : at + (b - a) * run.dtype.itemsize].view(run.dtype).copy_(own[a - lo : b - lo])
        return mine

    def _slot(self, block: int, gathered: Tensor) -> Tensor:
        """The gathered shares laid out as ``block``'s slot."""
        if self._in_place[block]:
            return gathered
        width = self._widths[block]
        slot = torch.empty(self.layout.block_bytes[block], dtype=torch.uint8, device=gathered.device)
        for rank, pieces in enumerate(self._pieces[block]):
            for run, a, b, at in pieces:
                start, size = run.offset + (a - run.start) * run.dtype.itemsize, (b - a) * run.dtype.itemsize
                slot[start : start + size] = gathered[rank * width + at : rank * width + at + size]
        return slot

    def _cut(self, block: int) -> list[list[Piece]]:
        """Per rank, the parts of ``block``'s slot runs its share holds, each aligned for its dtype in what
        the rank sends."""
        spec, pieces = self.store.blocks[block], []
        for rank in range(self.shard.world):
            lo, hi = Shard(rank, self.shard.world).owned(spec)
            rank_pieces, at = [], 0
            for run in self.layout.runs[block]:
                a, b = max(run.start, lo), min(run.end, hi)
                if a < b:
                    rank_pieces.append((run, a, b, at))
                    at = -(-(at + (b - a) * run.dtype.itemsize) // _PIECE_ALIGN) * _PIECE_ALIGN
            pieces.append(rank_pieces)
        return pieces

    def _lands_in_place(self, block: int) -> bool:
        """Whether every rank's parts arrive where the slot has them: the gathered buffer is the slot."""
        width = self._widths[block]
        return all(
            rank * width + at == run.offset + (a - run.start) * run.dtype.itemsize
            for rank, pieces in enumerate(self._pieces[block])
            for run, a, _, at in pieces
        )

    def _drop_in_flight(self) -> None:
        gathers, self._in_flight = self._in_flight, {}
        for gather in gathers.values():
            gather.work.wait()


def _packed_bytes(pieces: list[Piece]) -> int:
    if not pieces:
        return 0
    run, a, b, at = pieces[-1]
    return at + (b - a) * run.dtype.itemsize
