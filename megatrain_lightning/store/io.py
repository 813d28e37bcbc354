"""Block-sized file I/O at disk speed: O_DIRECT into page-aligned buffers, in threads that release
the GIL (``os.preadv``/``os.pwritev``), in chunks. Where the filesystem refuses O_DIRECT (tmpfs),
files are opened buffered instead, and that is logged once.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from megatrain_lightning.engine.chaos import point
from megatrain_lightning.store.layout import chunk_numel_for

log = logging.getLogger(__name__)
_warned_buffered: set[str] = set()
_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE (Linux)


class StoreIOError(OSError):
    """A read or write of the disk store failed; the message names the file and what to do."""


@dataclass(frozen=True)
class IOConfig:
    chunk_bytes: int = 16 << 20  # the store's chunk of a block (in fp32 bytes), and per preadv/pwritev call
    threads: int = 4  # blocks in flight at once (the queue depth, in blocks)
    direct: bool = True  # O_DIRECT where the filesystem allows it
    # The host tier's blocks in chunks too (``io_chunk_mb`` given); else only where it keeps a bf16 shadow
    # (engine/runtime.py, ``EngineConfig.make_store``): with every buffer in RAM a chunk bounds no memory.
    host_chunks: bool = False

    @property
    def chunk_numel(self) -> int:
        """Elements of a block per store chunk."""
        return chunk_numel_for(self.chunk_bytes)


class BlockFile:
    """One file of fixed size, preallocated unless ``sparse`` (then disk space is taken as regions are
    written); ``read``/``write`` move whole page-aligned regions."""

    def __init__(self, path: str, size: int, config: IOConfig, sparse: bool = False) -> None:
        self.path = path
        self.config = config
        self.direct = False
        flags = os.O_RDWR | os.O_CREAT
        if config.direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o600)
                self.direct = True
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise StoreIOError(err.errno, f"megatrain: cannot open {path}: {err.strerror}") from err
        if not self.direct:
            self.fd = os.open(path, flags, 0o600)
            folder = os.path.dirname(path)
            if config.direct and folder not in _warned_buffered:
                _warned_buffered.add(folder)
                log.warning(f"megatrain: {folder} refuses O_DIRECT (tmpfs?); using buffered I/O there.")
        self.sparse = sparse
        try:
            if sparse:
                os.ftruncate(self.fd, size)
            else:
                os.posix_fallocate(self.fd, 0, size)
        except OSError as err:
            os.close(self.fd)
            raise StoreIOError(
                err.errno, f"megatrain: cannot reserve {size / 1e9:.2f} GB for {path}: {err.strerror}"
            ) from err

    def release(self, offset: int, nbytes: int) -> None:
        """Give the disk space of a region whose contents are no longer needed back to the filesystem (a
        sparse file's consumed gradients: a first step spills most of them, and without this their space
        would stay taken until the run ends). Where the filesystem cannot punch holes the space stays."""
        if self.sparse and _fallocate(self.fd, _PUNCH_HOLE, offset, nbytes) != 0:
            self.sparse = False  # not supported here (errno EOPNOTSUPP): do not try again

    def read(self, offset: int, buf: Tensor) -> None:
        """Fill ``buf`` (a page-aligned uint8 tensor, whole pages long) from ``offset``."""
        view = memoryview(buf.numpy())
        for start in range(0, len(view), self.config.chunk_bytes):
            chunk = view[start : start + self.config.chunk_bytes]
            point("disk.read", self.path)
            self._check(os.preadv(self.fd, [chunk], offset + start), len(chunk), "read")

    def write(self, offset: int, buf: Tensor) -> None:
        view = memoryview(buf.numpy())
        for start in range(0, len(view), self.config.chunk_bytes):
            chunk = view[start : start + self.config.chunk_bytes]
            point("disk.write", self.path)
            self._check(os.pwritev(self.fd, [chunk], offset + start), len(chunk), "write")

    def _check(self, done: int, wanted: int, what: str) -> None:
        if done != wanted:
            raise StoreIOError(
                errno.EIO, f"megatrain: short {what} on {self.path} ({done} of {wanted} bytes)"
            )

    def close(self) -> None:
        os.close(self.fd)


def _fallocate(fd: int, mode: int, offset: int, nbytes: int) -> int:
    libc_fallocate = _libc_fallocate()
    return -1 if libc_fallocate is None else libc_fallocate(fd, mode, offset, nbytes)


@functools.cache
def _libc_fallocate() -> Callable[..., int] | None:
    try:
        libc_fallocate = ctypes.CDLL(None, use_errno=True).fallocate
    except (AttributeError, OSError):  # not Linux
        return None
    libc_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return libc_fallocate


def io_error(err: OSError, path: str, what: str) -> StoreIOError:
    """A clear error for a failed store read/write (the run stops; checkpoints are unaffected)."""
    hint = (
        "the disk under offload_dir is full: free space or point `offload_dir` at a larger disk"
        if err.errno == errno.ENOSPC
        else "check the disk under offload_dir"
    )
    return StoreIOError(err.errno, f"megatrain: {what} {path} failed: {err.strerror or err}; {hint}.")
