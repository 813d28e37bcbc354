"""The disk tier of the store: every block's buffers live in files under ``offload_dir`` (:mod:`.files`);
host RAM holds a bounded cache of them (``max_cpu_gb``), one arena region per (block, kind, chunk)
(:mod:`.cache`, :mod:`.chunks`).

Eviction is Belady's rule: ``hint`` ranks each block's weights, gradients and optimizer state by the
trace's next use of that kind, ``claim`` puts a submitted update's chunks first; pinned chunks stay, dirty
ones are written back first. The cache loads ahead in that order, a few chunks per I/O thread, and only
what is sure to stay until its use. Updated chunks are written back as soon as their update is done;
consumed gradients are dropped unwritten (and their disk space given back). So a step moves close to the
least its schedule allows (:func:`megatrain_lightning.planner.traffic.least_disk_traffic`), and because the
unit is a chunk the RAM the hot paths need is a few chunks per thread whatever the block size.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor
from typing_extensions import override

from megatrain_lightning.engine.futures import fresh_copy, result_of
from megatrain_lightning.engine.threads import worker_pool
from megatrain_lightning.store.arena import Arena, whole_pages_in
from megatrain_lightning.store.cache import NEVER, Entry, Key, best_window, failed
from megatrain_lightning.store.chunks import ChunkedSpans
from megatrain_lightning.store.files import STORE_DIRNAME, StoreFiles, close_files, lock_directory
from megatrain_lightning.store.host import HostStore, Span
from megatrain_lightning.store.io import BlockFile, IOConfig, StoreIOError, io_error
from megatrain_lightning.store.layout import Block
from megatrain_lightning.store.memory import pages
from megatrain_lightning.store.read_ahead import ReadAhead
from megatrain_lightning.telemetry.stats import EngineStats
from megatrain_lightning.telemetry.timeline import TIMELINE

_STALL_TIMEOUT_S = 120.0


class DiskStore(ChunkedSpans, ReadAhead, HostStore):
    def __init__(
        self,
        blocks: list[Block],
        offload_dir: str,
        cache_bytes: int,
        kinds: Iterable[str],
        pin_memory: bool = False,
        stats: EngineStats | None = None,
        io: IOConfig | None = None,
        keep: bool = False,
    ) -> None:
        """``kinds`` get their files now; any other kind on its first write-back."""
        self.io = io or IOConfig()
        super().__init__(blocks, pin_memory, stats, self.io.chunk_numel)
        self.directory = os.path.join(offload_dir, STORE_DIRNAME)
        os.makedirs(self.directory, exist_ok=True)
        self._lock_fd = lock_directory(self.directory)
        self._cond = threading.Condition()
        self._arena = Arena(cache_bytes, pin_memory)
        self._entries: dict[Key, Entry] = {}
        self._on_disk: set[Key] = set()  # regions holding data (others read as zeros)
        self._chunks = [self.spans(b) for b in range(len(blocks))]
        self._chunk_sizes: dict[Key, tuple[torch.dtype, int]] = {}
        self._start_ranking()
        self._demands_waiting = 0  # threads waiting for cache room
        self._failure: StoreIOError | None = None  # a failed write-back: the store is no longer whole
        # A failed read, read ahead or not: this run stops at its next pin (the files are whole: the next
        # run reads again).
        self._read_failure: StoreIOError | None = None
        self._workers = worker_pool(self.io.threads, "megatrain-io")
        self._files = StoreFiles(self.directory, self.io, blocks, self._chunks)
        for kind in kinds:
            self._open(kind)
        self._files.write_manifest()
        # The folders made for ``directory`` (by whoever made it), removed with the store when empty.
        self.made_dirs: list[str] = []
        self._cleanup = weakref.finalize(
            self, close_files, self._files.files, self._lock_fd, self.directory, keep, self.made_dirs
        )

    @property
    def cache_bytes(self) -> int:
        return self._arena.capacity

    def resize_cache(self, cache_bytes: int) -> None:
        """A new host-cache budget (a later strategy over the same model): everything cached is written
        back and dropped."""
        if whole_pages_in(cache_bytes) == self._arena.capacity:
            return
        self.flush()
        with self._cond:
            if any(entry.pins for entry in self._entries.values()):
                raise RuntimeError("megatrain: the host cache cannot be resized while blocks are in use")
            self._entries.clear()
            self._unused_ahead = 0
            self._arena = None  # freed (and unpinned) before the new one is allocated
            self._arena = Arena(cache_bytes, self.pin_memory)

    @override
    def define_kind(
        self, kind: str, dtype: torch.dtype, numel: Callable[[Block], int], span: Span | None = None
    ) -> None:
        with self._cond:
            super().define_kind(kind, dtype, numel, span)
            self._chunk_sizes.clear()  # a kind may change its layout (a new optimizer over the store)

    # -- the store API --

    @override
    def copy_spans(self, block: int) -> list[tuple[int, int]]:
        return self.spans(block)

    @contextlib.contextmanager
    def pinned(
        self, block: int, kind: str, write: bool = False, span: tuple[int, int] | None = None
    ) -> Iterator[Tensor]:
        with self.pinned_all(block, (kind,), write, span) as flats:
            yield flats[kind]

    @contextlib.contextmanager
    def pinned_all(
        self, block: int, kinds: Iterable[str], write: bool = False, span: tuple[int, int] | None = None
    ) -> Iterator[dict[str, Tensor]]:
        """Within one chunk: views of the cached chunks of all ``kinds``, pinned at once. Across chunks: a
        gathered copy (outside the cache), scattered back chunk by chunk if ``write``. A read waits for the
        block's announced change."""
        if not write:
            self.wait_for_change(block)
        kinds = list(kinds)
        chunks = self._chunks_in(block, span)
        if len(chunks) > 1:
            flats = self._gather(block, kinds, span)
            yield flats
            if write:
                self._scatter(block, flats, span)
            return
        (chunk,) = chunks
        with self._pinned_keys([(block, kind, chunk) for kind in kinds], write) as bufs:
            yield {
                kind: self._part(block, kind, chunk, span, buf) for kind, buf in zip(kinds, bufs, strict=True)
            }

    @contextlib.contextmanager
    def _pinned_keys(self, keys: list[Key], write: bool) -> Iterator[list[Tensor]]:
        """Pins all of ``keys`` at once: a thread never holds some while it waits for room for the
        others (two updates could each hold what the other needs). What is pinned is needed now:
        it ranks after the claims made earlier and before everything the trace predicts."""
        me = threading.get_ident()
        with self._cond:
            for failure in (self._failure, self._read_failure):
                if failure is not None:
                    raise fresh_copy(failure)
            # A claim made before a write stays until ``written``/``discard`` (a gradient sum whose update
            # follows stays cached until that update used it); the rest end with this pin.
            kept = {key for key in keys if write and key in self._claimed}
            for key in keys:
                self._claimed.setdefault(key, self._claim_rank())
            while missing := [key for key in keys if key not in self._entries]:
                self._admit(missing[0], demand=True, keep=frozenset(keys))
            entries = [self._entries[key] for key in keys]
            for key, entry in zip(keys, entries, strict=True):
                entry.holders.append(me)
                self._used(entry)
                if key not in kept:
                    self._claimed.pop(key, None)
        try:
            for entry in entries:
                for future in (entry.ready, entry.writing if write else None):
                    if future is not None:
                        result_of(future)  # a failed load or write-back raises here
            yield [entry.buf for entry in entries]
        finally:
            with self._cond:
                for key, entry in zip(keys, entries, strict=True):
                    entry.holders.remove(me)
                    if failed(entry.ready):  # never served again: the next pin reads anew
                        if not entry.pins:
                            self._evict(key, entry)
                    else:
                        entry.dirty |= write
                self._load_ahead()
                self._cond.notify_all()

    def read(self, block: int, kind: str) -> Tensor:
        if len(self._chunks[block]) > 1:
            self.wait_for_change(block)
            return self._gather(block, [kind], None)[kind]
        with self.pinned(block, kind) as buf:
            return buf.clone()

    def written(self, block: int, kinds: Iterable[str], span: tuple[int, int] | None = None) -> None:
        with self._cond:
            for kind in kinds:
                for chunk in self._chunks_in(block, span):
                    key = (block, kind, chunk)
                    self._claimed.pop(key, None)
                    entry = self._entries.get(key)
                    if entry is not None and entry.dirty and not entry.pins:
                        self._write_back(key, entry)

    def discard(self, block: int, kind: str, span: tuple[int, int] | None = None) -> None:
        with self._cond:
            for chunk in self._chunks_in(block, span):
                key = (block, kind, chunk)
                self._claimed.pop(key, None)
                entry = self._entries.get(key)
                if key in self._on_disk and (entry is None or not entry.busy):  # no write of it in flight
                    self._files.release(key, self._chunk_bytes(key)[1])  # under the lock: later writes follow
                self._on_disk.discard(key)
                if entry is not None and not entry.pins and not entry.busy:
                    self._evict(key, entry)
                elif entry is not None:
                    entry.dirty = False
            self._cond.notify_all()

    def forget_read_failures(self) -> None:
        with self._cond:
            self._read_failure = None
            for key, entry in list(self._entries.items()):
                if failed(entry.ready) and not entry.pins:
                    self._evict(key, entry)

    def stored_bytes(self, kind: str) -> int:
        """What reading (or writing) all of ``kind`` moves: its chunks in whole pages."""
        return sum(
            self._size((b, kind, c)) for b, spans in enumerate(self._chunks) for c in range(len(spans))
        )

    def release_all_but(self, *kinds: str) -> None:
        """Nothing to free at once: other kinds live in the block files until the store closes, and in a
        cache bounded by ``cache_bytes`` (a finalizer may not take ``_cond`` to evict them)."""

    def describe(self) -> str:
        return f"on disk in {self.directory}, through a host cache of {self.cache_bytes / 1e9:.3g} GB"

    def nbytes(self, *kinds: str) -> int:
        with self._cond:
            return self._arena.held()

    def flush(self) -> None:
        """Write every dirty entry back and wait until all writes are on disk."""
        with self._cond:
            for key, entry in list(self._entries.items()):
                if entry.dirty and not entry.pins:
                    self._write_back(key, entry)
            pending = [e.writing for e in self._entries.values() if e.writing is not None]
        for future in pending:
            result_of(future)

    def close(self) -> None:
        self.flush()
        self._workers.shutdown(wait=True)
        self._cleanup()

    # -- cache internals (lock held) --

    def _size(self, key: Key) -> int:
        """The cache bytes of ``key``'s chunk (whole pages)."""
        return pages(self._chunk_bytes(key)[1])

    def _chunk_bytes(self, key: Key) -> tuple[torch.dtype, int]:
        """``key``'s chunk's dtype and bytes (asked on every walk of the read-ahead: computed once)."""
        known = self._chunk_sizes.get(key)
        if known is None:
            block, kind, chunk = key
            start, stop = self.kind_span(block, kind, self._chunks[block][chunk])
            dtype = self.layout(block, kind)[0]
            known = self._chunk_sizes[key] = dtype, (stop - start) * dtype.itemsize
        return known

    def _admit(self, key: Key, demand: bool, keep: frozenset[Key] = frozenset()) -> Entry | None:
        """A cache entry for ``key``, loading it from disk if it has data there. For a prefetch
        (``demand=False``) only if nothing needed sooner has to leave; ``None`` otherwise. ``keep``: entries
        that must stay (the others a ``pinned_all`` is gathering)."""
        dtype, nbytes = self._chunk_bytes(key)
        size = pages(nbytes)
        offset = self._make_room(size, self._rank(key), demand, keep)
        if offset is None:
            return None
        if key in self._entries:  # admitted by another thread while this one waited for room
            self._arena.release(offset, size)
            return self._entries[key]
        raw = self._arena.region(offset, size)
        entry = Entry(offset, raw, raw[:nbytes].view(dtype), ahead=not demand)
        self._unused_ahead += size if entry.ahead else 0
        if key in self._on_disk:
            entry.ready = self._workers.submit(self._read, key, entry)
        else:
            entry.raw.zero_()
        self._entries[key] = entry
        self.stats.peak_host_cache_bytes = max(self.stats.peak_host_cache_bytes, self._arena.used)
        return entry

    def _make_room(self, size: int, rank: float, demand: bool, keep: frozenset[Key]) -> int | None:
        """The offset of a free region of ``size`` bytes, evicting (Belady) to make one, but only what is
        needed later than ``rank``. A prefetch gives up (``None``) rather than wait, and evicts only clean
        entries (a gradient spilled to make room for a guess is mostly consumed before it would have been
        evicted: a wasted write); a demand writes dirty ones back, waits while other threads hold or move
        entries, and otherwise takes the least bad region."""
        deadline = time.monotonic() + _STALL_TIMEOUT_S
        waited = False  # for a write-back: once, so that new write-backs cannot starve a demand
        while True:
            offset = self._arena.allocate(size)
            if offset is not None:
                return offset
            window = best_window(
                self._arena, self._entries, self._rank, size, rank, keep, not demand, writing_ok=not waited
            )
            if window is None and demand and not self._others_active():
                window = best_window(self._arena, self._entries, self._rank, size, -NEVER, keep)
                if window is None:
                    raise self._too_small()
            if window is not None:
                start, victims = window
                dirty = [(k, e) for k, e in victims if e.dirty]
                if not dirty and not any(e.busy for _, e in victims):
                    for victim in victims:
                        self._evict(*victim)
                    self._arena.allocate_at(start, size)
                    return start
                for victim in dirty:
                    self._write_back(*victim)  # evictable once written
            if not demand:
                return None
            waited = window is not None
            self._demands_waiting += 1  # no read-ahead meanwhile: it could take the room this waits for
            try:
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise self._too_small()
            finally:
                self._demands_waiting -= 1

    def _too_small(self) -> MemoryError:
        return MemoryError(
            f"megatrain: the host cache (max_cpu_gb={self.cache_bytes / 1e9:.3g}) is too small for the "
            "blocks in use at once; raise `max_cpu_gb`."
        )

    def _others_active(self) -> bool:
        """Whether an entry is in I/O or pinned by another thread (waiting may free room)."""
        me = threading.get_ident()
        return any(e.busy or any(h != me for h in e.holders) for e in self._entries.values())

    def _evict(self, key: Key, entry: Entry) -> None:
        self._used(entry)
        del self._entries[key]
        self._arena.release(entry.offset, entry.size)

    def _write_back(self, key: Key, entry: Entry) -> None:
        if entry.dirty and not entry.busy:
            entry.dirty = False
            entry.writing = self._workers.submit(self._write, key, entry)

    # -- I/O (worker threads, lock not held) --

    def _read(self, key: Key, entry: Entry) -> None:
        block, kind, chunk = key
        file = self._files.files[kind]
        start = time.perf_counter()
        try:
            file.read(self._files.offsets[kind][block][chunk], entry.raw)
        except OSError as err:
            failure = io_error(err, file.path, "reading")
            with self._cond:
                self._read_failure = failure
            raise failure from err
        finally:
            self._done()
        TIMELINE.record("disk", start, time.perf_counter())
        self.stats.add(disk_read_s=time.perf_counter() - start, disk_read_bytes=entry.raw.numel())

    def _write(self, key: Key, entry: Entry) -> None:
        block, kind, chunk = key
        file = self._open(kind)
        start = time.perf_counter()
        try:
            file.write(self._files.offsets[kind][block][chunk], entry.raw)
            with self._cond:
                self._on_disk.add(key)
        except OSError as err:
            failure = io_error(err, file.path, "writing")
            with self._cond:
                self._failure = failure
            raise failure from err
        finally:
            self._done(wrote=True)
        TIMELINE.record("disk", start, time.perf_counter())
        self.stats.add(disk_write_s=time.perf_counter() - start, disk_write_bytes=entry.raw.numel())

    def _done(self, wrote: bool = False) -> None:
        """An I/O finished: waiters may go on; a written entry may now leave for a chunk read ahead."""
        with self._cond:
            if wrote:
                self._load_ahead()
            self._cond.notify_all()

    def _open(self, kind: str) -> BlockFile:
        with self._cond:
            return self._files.open(kind, lambda block, chunk: self._chunk_bytes((block, kind, chunk))[1])
