"""The disk tier of the store: every block's buffers live in files under ``offload_dir``; host RAM
holds a bounded cache of them (``max_cpu_gb``).

Files: one preallocated file per kind (``param.bin``, ``exp_avg.bin``, ...) with each block at a
page-aligned offset, a ``manifest.json`` describing the layout, and a lock so two runs cannot
share the folder. Cache: entries are pinned while in use; eviction takes the entry whose block is
needed farthest in the future by the trace (Belady), never a pinned one, and writes dirty entries
back first. ``hint`` (the trace's future) loads ahead in that order as far as the cache allows
without evicting anything needed sooner. Updated blocks are written back as soon as their update
is done; consumed gradients are dropped without being written.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from megatrain_lightning.blocks import Block
from megatrain_lightning.io import BlockFile, IOConfig, StoreIOError, io_error
from megatrain_lightning.stats import EngineStats
from megatrain_lightning.store import ALIGNMENT, HostStore, aligned_empty
from megatrain_lightning.timeline import TIMELINE

STORE_DIRNAME = "megatrain_store"
_NEVER = float("inf")
_STALL_TIMEOUT_S = 120.0


def _pages(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


@dataclass(eq=False)
class _Entry:
    raw: Tensor  # page-aligned uint8, whole pages: what the I/O reads and writes
    buf: Tensor  # the typed view callers get
    pins: int = 0
    dirty: bool = False
    ready: Future | None = None  # the load from disk
    writing: Future | None = None  # a write-back in flight

    @property
    def busy(self) -> bool:
        return any(f is not None and not f.done() for f in (self.ready, self.writing))


class DiskStore(HostStore):
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
        super().__init__(blocks, pin_memory, stats)
        self.directory = os.path.join(offload_dir, STORE_DIRNAME)
        self.cache_bytes = cache_bytes
        self.io = io or IOConfig()
        os.makedirs(self.directory, exist_ok=True)
        self._lock_fd = _lock(self.directory)
        self._cond = threading.Condition()
        self._entries: dict[tuple[int, str], _Entry] = {}
        self._on_disk: set[tuple[int, str]] = set()  # regions holding data (others read as zeros)
        self._pool: dict[int, list[tuple[Tensor, Tensor]]] = {}  # free buffers by byte size
        self._allocated = 0  # bytes of cache buffers, in use or pooled
        self._future: dict[int, int] = {}  # block -> rank of its next predicted use
        self._failure: StoreIOError | None = None  # a failed write-back: the store is no longer whole
        self._workers = ThreadPoolExecutor(self.io.threads, thread_name_prefix="megatrain-io")
        self._files: dict[str, BlockFile] = {}
        self._offsets: dict[str, list[int]] = {}
        for kind in kinds:
            self._open(kind)
        self._write_manifest()
        self._cleanup = weakref.finalize(self, _remove, self._files, self._lock_fd, self.directory, keep)

    # -- the store API --

    @contextlib.contextmanager
    def pinned(self, block: int, kind: str, write: bool = False) -> Iterator[Tensor]:
        key = (block, kind)
        with self._cond:
            if self._failure is not None:
                raise self._failure
            entry = self._entries.get(key) or self._admit(key, demand=True)
            entry.pins += 1
        try:
            for future in (entry.ready, entry.writing if write else None):
                if future is not None:
                    future.result()  # a failed load or write-back raises here
            yield entry.buf
        finally:
            with self._cond:
                entry.pins -= 1
                entry.dirty |= write
                self._cond.notify_all()

    def read(self, block: int, kind: str) -> Tensor:
        with self.pinned(block, kind) as buf:
            return buf.clone()

    def written(self, block: int, kinds: Iterable[str]) -> None:
        with self._cond:
            for kind in kinds:
                entry = self._entries.get((block, kind))
                if entry is not None and entry.dirty and not entry.pins:
                    self._write_back((block, kind), entry)

    def discard(self, block: int, kind: str) -> None:
        key = (block, kind)
        with self._cond:
            self._on_disk.discard(key)
            entry = self._entries.get(key)
            if entry is not None and not entry.pins and not entry.busy:
                self._evict(key, entry)
            elif entry is not None:
                entry.dirty = False
            self._cond.notify_all()

    def hint(self, future: list[tuple[int, bool]]) -> None:
        """Rank blocks by next predicted use and load ahead in that order while the cache allows."""
        with self._cond:
            self._future = {}
            for rank, (block, _) in enumerate(future):
                self._future.setdefault(block, rank)
            for rank, (block, backward) in enumerate(future):
                if self._future[block] != rank:
                    continue
                for kind in ("param", "exp_avg", "exp_avg_sq") if backward else ("param",):
                    key = (block, kind)
                    if key in self._entries or key not in self._on_disk:
                        continue
                    if self._admit(key, demand=False) is None:
                        return

    def nbytes(self, *kinds: str) -> int:
        with self._cond:
            return self._allocated

    def flush(self) -> None:
        """Write every dirty entry back and wait until all writes are on disk."""
        with self._cond:
            for key, entry in list(self._entries.items()):
                if entry.dirty and not entry.pins:
                    self._write_back(key, entry)
            pending = [e.writing for e in self._entries.values() if e.writing is not None]
        for future in pending:
            future.result()

    def close(self) -> None:
        self.flush()
        self._workers.shutdown(wait=True)
        self._cleanup()

    # -- cache internals (lock held) --

    def _admit(self, key: tuple[int, str], demand: bool) -> _Entry | None:
        """A cache entry for ``key``, loading it from disk if it has data there. For a prefetch
        (``demand=False``) only if nothing needed sooner has to leave; ``None`` otherwise."""
        dtype, numel = self.layout(*key)
        nbytes = numel * dtype.itemsize
        size = _pages(nbytes)
        if not self._make_room(size, self._rank(key[0]), demand):
            return None
        pooled = self._pool.get(size)
        if pooled:
            raw, _ = pooled.pop()
        else:
            raw = aligned_empty(size, torch.uint8, self.pin_memory)
            self._allocated += size
            self.stats.peak_host_cache_bytes = max(self.stats.peak_host_cache_bytes, self._allocated)
        entry = _Entry(raw, raw[:nbytes].view(dtype))
        if key in self._on_disk:
            entry.ready = self._workers.submit(self._read, key, entry)
        else:
            entry.raw.zero_()
        self._entries[key] = entry
        self.stats.host_bytes = self._allocated
        return entry

    def _rank(self, block: int) -> float:
        return self._future.get(block, _NEVER)

    def _make_room(self, size: int, rank: float, demand: bool) -> bool:
        deadline = time.monotonic() + _STALL_TIMEOUT_S
        while True:
            if size in self._pool and self._pool[size]:
                return True
            if self._allocated + size <= self.cache_bytes:
                return True
            if self._drop_pooled(size):
                continue
            # Belady: the idle entry whose block is needed farthest in the future; a prefetch may
            # only take entries needed later than what it loads.
            idle = [
                (k, e)
                for k, e in self._entries.items()
                if not e.pins and not e.busy and (demand or self._rank(k[0]) > rank)
            ]
            idle.sort(key=lambda item: self._rank(item[0][0]), reverse=True)
            clean = [(k, e) for k, e in idle if not e.dirty]
            if clean:
                self._evict(*clean[0])
                continue
            for key, entry in idle[:2]:
                self._write_back(key, entry)  # dirty ones become evictable once written
            if not demand:
                return False
            if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                raise MemoryError(
                    f"megatrain: the host cache (max_cpu_gb={self.cache_bytes / 1e9:.3g}) is too small for "
                    "the blocks in use at once; raise `max_cpu_gb`."
                )

    def _drop_pooled(self, size: int) -> bool:
        """Free a pooled buffer of another size to make room for ``size``."""
        for other, buffers in self._pool.items():
            if other != size and buffers:
                buffers.pop()
                self._allocated -= other
                return True
        return False

    def _evict(self, key: tuple[int, str], entry: _Entry) -> None:
        del self._entries[key]
        self._pool.setdefault(entry.raw.numel(), []).append((entry.raw, entry.buf))

    def _write_back(self, key: tuple[int, str], entry: _Entry) -> None:
        if entry.dirty and not entry.busy:
            entry.dirty = False
            entry.writing = self._workers.submit(self._write, key, entry)

    # -- I/O (worker threads, lock not held) --

    def _read(self, key: tuple[int, str], entry: _Entry) -> None:
        block, kind = key
        file = self._files[kind]
        start = time.perf_counter()
        try:
            file.read(self._offsets[kind][block], entry.raw)
        except OSError as err:
            raise io_error(err, file.path, "reading") from err
        finally:
            self._done()
        TIMELINE.record("disk", start, time.perf_counter())
        self.stats.disk_read_s += time.perf_counter() - start
        self.stats.disk_read_bytes += entry.raw.numel()

    def _write(self, key: tuple[int, str], entry: _Entry) -> None:
        block, kind = key
        file = self._files.get(kind) or self._open(kind)
        start = time.perf_counter()
        try:
            file.write(self._offsets[kind][block], entry.raw)
            with self._cond:
                self._on_disk.add(key)
        except OSError as err:
            failure = io_error(err, file.path, "writing")
            with self._cond:
                self._failure = failure
            raise failure from err
        finally:
            self._done()
        TIMELINE.record("disk", start, time.perf_counter())
        self.stats.disk_write_s += time.perf_counter() - start
        self.stats.disk_write_bytes += entry.raw.numel()

    def _done(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # -- files --

    def _open(self, kind: str) -> BlockFile:
        with self._cond:
            if kind in self._files:
                return self._files[kind]
            offsets, end = [], 0
            for block in range(len(self.blocks)):
                dtype, numel = self.layout(block, kind)
                offsets.append(end)
                end += _pages(numel * dtype.itemsize)
            path = os.path.join(self.directory, f"{kind}.bin")
            self._files[kind] = BlockFile(path, max(end, ALIGNMENT), self.io)
            self._offsets[kind] = offsets
            return self._files[kind]

    def _write_manifest(self) -> None:
        manifest = {
            "format": 1,
            "blocks": [
                {
                    "name": b.name,
                    "numel": b.numel,
                    "params": [[p.name, list(p.shape), p.offset] for p in b.params],
                }
                for b in self.blocks
            ],
            "files": {kind: {"path": f"{kind}.bin", "offsets": self._offsets[kind]} for kind in self._files},
        }
        path = os.path.join(self.directory, "manifest.json")
        with open(path + ".tmp", "w") as f:
            json.dump(manifest, f, indent=1)
        os.replace(path + ".tmp", path)


def _lock(directory: str) -> int:
    fd = os.open(os.path.join(directory, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as err:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise StoreIOError(
            err.errno, f"megatrain: {directory} is in use by {owner}; give each run its own `offload_dir`."
        ) from err
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
    return fd


def _remove(files: dict[str, BlockFile], lock_fd: int, directory: str, keep: bool) -> None:
    for file in files.values():
        file.close()
    if not keep:
        shutil.rmtree(directory, ignore_errors=True)
    os.close(lock_fd)


def region_bytes(blocks: list[Block]) -> int:
    """Disk bytes of one fp32 kind (e.g. the master weights) for ``blocks``."""
    return sum(_pages(4 * b.numel) for b in blocks)
