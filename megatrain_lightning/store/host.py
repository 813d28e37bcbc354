"""The store: the authoritative host copy of every block.

Each block owns one flat, page-aligned fp32 buffer of master weights (kind ``"param"``) and,
beside it, flat buffers of the same layout for gradients and optimizer state (other kinds).
Everything that reads or writes a block's numbers goes through ``pinned``, so the disk tier
(:class:`megatrain_lightning.store.disk.DiskStore`) only changes where these buffers live and when
they move. In this host tier every buffer stays in RAM for the store's whole life.

A block's buffers are also cut into *chunks* (``spans``: the same element ranges for every kind), the unit
the disk tier caches, reads and writes: callers on the hot path (fetch, gradient add, update) pin one
``span`` at a time, so the memory they need is a few chunks, whatever the block size.

The store also keeps the rule that makes asynchronous updates safe: whoever is about to change a
block's weights says so first (``will_change``, with the future of an update running elsewhere).
That moves the block's ``version`` on, so every copy taken before (a device slot) knows it is stale,
and reads of the block wait until the change is done. Readers never need to know who changes what.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future

import torch
from torch import Tensor

from megatrain_lightning.engine.chaos import point
from megatrain_lightning.engine.futures import result_of
from megatrain_lightning.store.layout import CHUNK_NUMEL, Block, chunk_spans
from megatrain_lightning.store.memory import host_empty
from megatrain_lightning.telemetry.stats import EngineStats

log = logging.getLogger(__name__)


class HostStore:
    """Per-block flat host buffers by kind (``param``, ``grad``, ``exp_avg``, ...), all in RAM."""

    drops_discarded = False  # whether ``discard`` loses the contents (the disk tier's cache does)

    def __init__(
        self,
        blocks: list[Block],
        pin_memory: bool = False,
        stats: EngineStats | None = None,
        chunk_numel: int = CHUNK_NUMEL,
    ) -> None:
        self.blocks = blocks
        self.chunk_numel = chunk_numel
        self.pin_memory = pin_memory
        self.stats = stats or EngineStats()
        self._buffers: dict[tuple[int, str], Tensor] = {}
        self._kinds: dict[str, tuple[torch.dtype, Callable[[Block], int], Span]] = {}
        self._lock = threading.Lock()
        self._versions = [0] * len(blocks)
        self._changes: dict[int, Future] = {}  # block -> the update changing it (kept once done)

    def define_kind(
        self, kind: str, dtype: torch.dtype, numel: Callable[[Block], int], span: Span | None = None
    ) -> None:
        """Buffers of ``kind`` hold ``numel(block)`` elements of ``dtype`` (default: fp32, block layout);
        ``span(block, start, stop)`` is the range of them that block elements ``[start, stop)`` own
        (default: the same range). Over a block's ``spans`` these ranges must cover the buffer in order."""
        self._kinds[kind] = (dtype, numel, span or _same_span)

    def layout(self, block: int, kind: str) -> tuple[torch.dtype, int]:
        dtype, numel, _ = self._kinds.get(kind, _FP32)
        return dtype, numel(self.blocks[block])

    def spans(self, block: int) -> list[tuple[int, int]]:
        """``block``'s chunks: consecutive element ranges of at most ``chunk_numel`` covering it."""
        return chunk_spans(self.blocks[block].numel, self.chunk_numel)

    def kind_span(self, block: int, kind: str, span: tuple[int, int] | None) -> tuple[int, int]:
        """The range of ``kind``'s buffer that block elements ``span`` (``None``: all) own."""
        if span is None:
            return 0, self.layout(block, kind)[1]
        return self._kinds.get(kind, _FP32)[2](self.blocks[block], *span)

    def will_change(self, block: int, done: Future | None = None) -> None:
        """``block``'s weights are about to change: copies taken before are stale from now on, and until
        ``done`` (the change running in another thread) resolves, reads of the block wait for it."""
        with self._lock:
            self._versions[block] += 1
            if done is None:
                self._changes.pop(block, None)
            else:
                self._changes[block] = done

    def version(self, block: int) -> int:
        """Moves on whenever ``block``'s weights are about to change; a copy taken at one version is
        current while the version stays."""
        return self._versions[block]

    def wait_for_change(self, block: int) -> None:
        """Wait until the change announced for ``block`` (if any) is done; raise if it failed (its weights
        are then neither the old nor the new ones: nothing may read them)."""
        point("store.wait")
        with self._lock:
            change = self._changes.get(block)
        if change is None:
            return
        if not change.done():
            start = time.perf_counter()
            change.exception()
            self.stats.add(optimizer_wait_s=time.perf_counter() - start)
        result_of(change)

    def accept_failed_changes(self) -> None:
        """The run whose changes failed has stopped and reported it: read those blocks as they are."""
        with self._lock:
            for block, change in list(self._changes.items()):
                if change.done() and change.exception() is not None:
                    del self._changes[block]

    @contextlib.contextmanager
    def pinned(
        self, block: int, kind: str, write: bool = False, span: tuple[int, int] | None = None
    ) -> Iterator[Tensor]:
        """The flat buffer of ``kind`` for ``block`` (zeros until first written), or the part of it that
        block elements ``span`` own, held for the context. A read waits for the block's announced change;
        a writer is the change, or ordered after it."""
        if not write:
            self.wait_for_change(block)
        start, stop = self.kind_span(block, kind, span)
        yield self._buffer(block, kind)[start:stop]

    @contextlib.contextmanager
    def rewriting(self, block: int, kind: str = "param") -> Iterator[Tensor]:
        """``pinned(write=True)`` for a change made in this thread (loading weights): after the block's
        pending change, copies taken before go stale, and the new contents are written back."""
        self.wait_for_change(block)
        self.will_change(block)
        with self.pinned(block, kind, write=True) as flat:
            yield flat
        self.written(block, [kind])

    @contextlib.contextmanager
    def pinned_all(
        self, block: int, kinds: Iterable[str], write: bool = False, span: tuple[int, int] | None = None
    ) -> Iterator[dict[str, Tensor]]:
        """``pinned`` for several kinds of ``block`` at once (what an update uses), by kind."""
        with contextlib.ExitStack() as stack:
            yield {kind: stack.enter_context(self.pinned(block, kind, write, span)) for kind in kinds}

    def read(self, block: int, kind: str) -> Tensor:
        """The current contents, for callers that keep them (state dicts): the buffer itself here."""
        self.wait_for_change(block)
        return self._buffer(block, kind)

    def read_span(self, block: int, kind: str, span: tuple[int, int]) -> Tensor:
        """A copy of block elements ``span`` of ``kind`` (one parameter's values)."""
        with self.pinned(block, kind, span=span) as flat:
            return flat.clone()

    def written(self, block: int, kinds: Iterable[str], span: tuple[int, int] | None = None) -> None:
        """``kinds`` of ``block`` (of the chunk ``span``) changed: the disk tier writes them back (nothing
        to do here)."""

    def discard(self, block: int, kind: str, span: tuple[int, int] | None = None) -> None:
        """The contents of ``kind`` (of the chunk ``span``) are no longer needed (a consumed gradient):
        kept allocated here."""

    def hint(self, future: Iterable[tuple[int, tuple[str, ...]]]) -> None:
        """The predicted coming accesses, in order, each a block and the kinds it will use; a tier
        with a cache ranks what it holds by them and loads ahead."""

    def claim(self, block: int, kinds: Iterable[str]) -> None:
        """``kinds`` of ``block`` are pinned next, ahead of every predicted access (a submitted update)."""

    def nbytes(self, *kinds: str) -> int:
        """Bytes of host memory the store holds (for ``kinds``, or all): whole pages, as allocated (and
        page-locked, for pinned weights)."""
        return sum(
            b.untyped_storage().nbytes() for (_, k), b in self._buffers.items() if not kinds or k in kinds
        )

    def forget_read_failures(self) -> None:
        """The run a failed read stopped is over (or a new one starts): the files are whole, so reads may
        be tried again (the disk tier refuses every pin after a failed read until then)."""

    def release_all_but(self, *kinds: str) -> None:
        """Free every buffer not of ``kinds`` (the state of a run that ended). Without the lock, by single
        dict operations: this runs from a finalizer, which may interrupt any thread, even one holding it."""
        for key in [key for key in list(self._buffers) if key[1] not in kinds]:
            self._buffers.pop(key, None)

    def flush(self) -> None:
        """Make the authoritative copy complete (the disk tier writes its dirty cache back)."""

    def close(self) -> None:
        """Release resources (files, threads); the host tier has none."""

    def _buffer(self, block: int, kind: str) -> Tensor:
        key = (block, kind)
        buf = self._buffers.get(key)
        if buf is None:
            with self._lock:
                buf = self._buffers.get(key)
                if buf is None:
                    dtype, numel = self.layout(block, kind)
                    # Only weights cross to the device; gradients and optimizer state stay pageable.
                    pinned = self.pin_memory and kind == "param"
                    buf = host_empty(numel, dtype, pinned)  # zeros: fresh pages
                    self._buffers[key] = buf
        return buf


Span = Callable[[Block, int, int], tuple[int, int]]


def _same_span(block: Block, start: int, stop: int) -> tuple[int, int]:
    return start, stop


_FP32 = (torch.float32, lambda b: b.numel, _same_span)
