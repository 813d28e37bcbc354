"""The pager: fixed pools of device slots that blocks are copied into while they are needed.

A slot holds a block's parameters, each in its dtype (:mod:`.slots`); there is a pool of slots per block
size (:func:`.slots.slot_pools`), and a block takes a slot of its size or larger. ``acquire`` makes a
block resident and pins it; ``release`` unpins it, but the copy stays cached until a slot is needed for
another block or the block's weights change: each copy remembers the store's ``version`` of its block,
and a copy whose version the store has moved on is stale (the pager asks the store; no one tells the
pager). While the trace predicts the future, free slots are filled ahead of time by one worker thread
(on CUDA through a copy stream whose copies the compute stream waits for by event), and the evicted
block is the one needed farthest in the future (Belady) among the slots the new block fits (the smallest
such slot on a tie, so that small blocks leave large slots to large ones). A load reads the store, which
makes it wait for a pending update of the block. The compute thread never waits for a copy on the host:
a slot is ``ready`` once its copy is queued, and the host buffer the copy reads stays pinned in the
store until a worker thread (the prefetcher, or for on-demand loads a copy waiter) has seen it finish.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future

import torch
from torch import Tensor

from megatrain_lightning.engine.chaos import point
from megatrain_lightning.engine.futures import result_of
from megatrain_lightning.engine.slots import SlotLayout
from megatrain_lightning.engine.threads import worker_pool
from megatrain_lightning.engine.trace import Trace
from megatrain_lightning.store.host import SHADOW, HostStore
from megatrain_lightning.telemetry.stats import EngineStats
from megatrain_lightning.telemetry.timeline import TIMELINE

log = logging.getLogger(__name__)

_NEVER = float("inf")
_CHUNKS_IN_FLIGHT = 2  # store chunks a device copy holds pinned at once


class _Slot:
    def __init__(self, buf: Tensor) -> None:
        self.buf = buf
        self.block: int | None = None
        self.version = -1  # the store's version of ``block`` when its load began
        self.pins = 0
        self.nbytes = buf.numel()
        self.ready: Future | None = None  # the copy is queued (the compute stream waits for ``copied``)
        self.done: Future | None = None  # the load is over: its host buffer released, the slot settled
        cuda = buf.is_cuda
        self.copied = torch.cuda.Event(blocking=True) if cuda else None  # the worker sleeps on it
        self.released = torch.cuda.Event() if cuda else None

    @property
    def loading(self) -> bool:
        return self.done is not None and not self.done.done()

    def start_load(self) -> None:
        self.ready, self.done = Future(), Future()


class Pager:
    def __init__(
        self,
        store: HostStore,
        device: torch.device,
        layout: SlotLayout,
        pools: Iterable[tuple[int, int]],
        prefetch_depth: int,
        stats: EngineStats,
    ) -> None:
        """``pools``: ``(slot bytes, number of slots)`` per size (:func:`.slots.slot_pools`)."""
        self.store = store
        self.device = device
        self.layout = layout
        self.prefetch_depth = prefetch_depth
        self.trace = Trace()
        self.stats = stats
        self._slots = [
            _Slot(torch.empty(size, dtype=torch.uint8, device=device))
            for size, count in sorted(pools)
            for _ in range(count)
        ]
        if max((s.nbytes for s in self._slots), default=-1) < layout.nbytes:
            raise ValueError(f"megatrain: no device slot holds the largest block ({layout.nbytes} bytes)")
        self._resident: dict[int, _Slot] = {}
        self._cond = threading.Condition()
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._worker = worker_pool(1, "megatrain-prefetch")
        # Waits for on-demand copies and unpins their host buffers; never queued behind a prefetch, which
        # may wait (disk tier) for the room those pins hold.
        cuda = self._copy_stream is not None
        self._copy_waiter = worker_pool(1, "megatrain-copy-wait") if cuda else None

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def nbytes(self) -> int:
        """Device memory the slots take."""
        return sum(s.nbytes for s in self._slots)

    def begin_pass(self, kind: str) -> None:
        with self._cond:
            self.trace.begin_pass(kind)

    def acquire(self, block: int, backward: bool) -> Tensor:
        """Make ``block`` resident, pin it and return its slot (bytes; ``layout.view`` finds a parameter)."""
        start = time.perf_counter()
        point("pager.acquire")
        with self._cond:
            self.trace.access((block, backward))
            self._drop_stale()
            slot = self._resident.get(block)
            load_here = slot is None
            if load_here:
                slot = self._claim(block, _NEVER, demand=True)
                slot.start_load()
            slot.pins += 1
            self._prefetch_ahead()
        if load_here:  # the wait for the copy to finish, if any, is another thread's
            self._load(slot, block, self._copy_waiter.submit if self._copy_waiter is not None else _call)
        try:
            result_of(slot.ready)
        except BaseException:  # ``_load`` already forgot the block
            with self._cond:
                slot.pins -= 1
                self._cond.notify_all()
            raise
        if slot.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.copied)
        self.stats.add(fetch_wait_s=time.perf_counter() - start)
        return slot.buf

    def view(self, block: int, index: int, slot: Tensor) -> Tensor:
        """Parameter ``index`` of ``block`` in its acquired ``slot``, shaped."""
        return self.layout.view(block, index, slot)

    def release(self, block: int) -> None:
        with self._cond:
            slot = self._resident[block]
            slot.pins -= 1
            if slot.released is not None:
                slot.released.record(torch.cuda.current_stream(self.device))
            self._cond.notify_all()
        if slot.version != self.store.version(block):
            raise RuntimeError(f"megatrain: block {block} changed while in use on the device")

    def is_last_use(self, block: int) -> bool:
        with self._cond:
            return self.trace.is_last_use(block)

    def close(self) -> None:
        """Stop the workers and free the slots' device memory (an engine, and so its pager, may outlive its
        run: the trainer holds it until it is collected)."""
        self._worker.shutdown(wait=True)
        if self._copy_waiter is not None:
            self._copy_waiter.shutdown(wait=True)
        with self._cond:
            self._resident.clear()
            self._slots = []

    # -- internals (called with the lock held unless said otherwise) --

    def _next_uses(self) -> dict[int, int]:
        uses: dict[int, int] = {}
        for i, (block, _) in enumerate(self.trace.upcoming()):
            uses.setdefault(block, i)
        return uses

    def _claim(self, block: int, need_at: float, demand: bool) -> _Slot | None:
        """A slot that ``block`` fits: an empty one, else the cached block used farthest in the future;
        the smallest on a tie."""
        fitting = [s for s in self._slots if s.nbytes >= self.layout.block_bytes[block]]
        while True:
            uses = self._next_uses()
            free = [s for s in fitting if not s.pins and not s.loading]
            victim = min(
                free, key=lambda s: (s.block is not None, -uses.get(s.block, _NEVER), s.nbytes), default=None
            )
            if victim is not None and (
                demand or victim.block is None or uses.get(victim.block, _NEVER) > need_at
            ):
                if victim.block is not None:
                    del self._resident[victim.block]
                victim.block, victim.version = block, self.store.version(block)
                self._resident[block] = victim
                self._note_peak()
                return victim
            if not demand:
                return None
            if not any(s.loading for s in fitting):
                raise RuntimeError(
                    f"megatrain: all {len(fitting)} device slots that hold block {block} are pinned; raise "
                    "`max_vram_gb` so that more blocks fit at once"
                )
            self._cond.wait()

    def _drop_stale(self) -> None:
        """Forget the copies of blocks whose weights changed since (a copy still loading settles as free)."""
        for block, slot in list(self._resident.items()):
            if slot.version == self.store.version(block):
                continue
            if slot.pins:
                raise RuntimeError(f"megatrain: block {block} changed while in use on the device")
            del self._resident[block]
            if not slot.loading:
                slot.block = None

    def _prefetch_ahead(self) -> None:
        uses = self._next_uses()
        wanted = [b for b in uses if b not in self._resident][: self.prefetch_depth]
        for block in sorted(wanted, key=uses.get):
            slot = self._claim(block, uses[block], demand=False)
            if slot is None:  # a later block may still fit a slot of another size
                continue
            slot.start_load()
            self._worker.submit(self._load, slot, block, _call)

    def _load(self, slot: _Slot, block: int, finish: Callable[..., object]) -> None:
        """Queue the copy of ``block``'s master weights into ``slot`` and resolve ``slot.ready``; then
        ``finish(self._finish_load, ...)`` (inline, or in the worker) (lock not held)."""
        unpin = contextlib.ExitStack()
        try:
            point("pager.load.before")
            self.store.wait_for_change(block)  # a pending update of the block
            start = time.perf_counter()
            nbytes = self._copy_chunks(slot, block, unpin)
            point("pager.load.after")
        except BaseException as err:  # surfaces in the waiting compute thread
            unpin.close()
            slot.ready.set_exception(err)
            self._settle(slot, block, err, forget=True)
            return
        slot.ready.set_result(None)
        finish(self._finish_load, slot, block, unpin, start, nbytes)

    def _copy_chunks(self, slot: _Slot, block: int, unpin: contextlib.ExitStack) -> int:
        """Copy ``block``'s master weights (its bf16 runs from the store's shadow, if it keeps one) into
        ``slot`` one of the store's ``copy_spans`` at a time (the disk tier's cached chunks; the host
        tier's whole block), each pinned only while a copy reads it: at most
        ``_CHUNKS_IN_FLIGHT`` on CUDA, the rest released as their copies finish; those still in flight are
        left to ``unpin``. Returns the bytes read from the host."""
        in_flight: collections.deque[tuple[torch.cuda.Event, contextlib.ExitStack]] = collections.deque()
        unpin.callback(lambda: [pin.close() for _, pin in in_flight])
        kinds, nbytes = ("param", SHADOW) if self.store.shadow_runs(block) else ("param",), 0
        for span in self.store.copy_spans(block):
            if self._copy_stream is None:
                with self.store.pinned_all(block, kinds, span=span) as src:
                    nbytes += self.layout.copy_in(
                        block, src["param"], slot.buf, span=span, shadow=src.get(SHADOW)
                    )
                continue
            copied, pin = torch.cuda.Event(blocking=True), contextlib.ExitStack()
            in_flight.append((copied, pin))
            src = pin.enter_context(self.store.pinned_all(block, kinds, span=span))
            with torch.cuda.stream(self._copy_stream):
                if span[0] == 0:
                    self._copy_stream.wait_event(slot.released)
                nbytes += self.layout.copy_in(
                    block, src["param"], slot.buf, non_blocking=True, span=span, shadow=src.get(SHADOW)
                )
                copied.record(self._copy_stream)
            if len(in_flight) > _CHUNKS_IN_FLIGHT:
                event, done = in_flight.popleft()
                event.synchronize()
                done.close()
        if self._copy_stream is not None:
            slot.copied.record(self._copy_stream)
        return nbytes

    def _finish_load(
        self, slot: _Slot, block: int, unpin: contextlib.ExitStack, start: float, nbytes: int
    ) -> None:
        """Wait until the copy has read the host buffer, then release it and settle the slot."""
        try:
            with unpin:  # the host buffer stays pinned until the copy has read it
                if slot.copied is not None:
                    slot.copied.synchronize()
        except BaseException as err:  # a device error: sticky, the compute stream's next call raises it too
            log.error(f"megatrain: copying block {block} to the device failed: {err!r}")
            self._settle(slot, block, err)
            return
        end = time.perf_counter()
        TIMELINE.record("fetch", start, end)
        self.stats.add(h2d_s=end - start, h2d_bytes=nbytes)
        self._settle(slot, block)

    def _settle(
        self, slot: _Slot, block: int, error: BaseException | None = None, forget: bool = False
    ) -> None:
        """End a load (``error``: how it failed; ``forget``: its copy was never queued); a copy that went
        stale while it loaded leaves its slot free."""
        with self._cond:
            if forget and self._resident.get(block) is slot:
                # Surfaced to whoever waits for it now; later acquires load again (nothing stale: the
                # retry succeeds with the right weights or fails again), so no failure outlives its run.
                del self._resident[block]
            if self._resident.get(block) is not slot:
                slot.block = None
            if error is None:
                slot.done.set_result(None)
            else:
                slot.done.set_exception(error)
            self._cond.notify_all()

    def _note_peak(self) -> None:
        held = sum(self.layout.block_bytes[s.block] for s in self._slots if s.block is not None)
        self.stats.peak_slot_bytes = max(self.stats.peak_slot_bytes, held)


def _call(function: Callable[..., object], *args: object) -> None:
    function(*args)
