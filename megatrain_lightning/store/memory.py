"""Host memory for the store and its caches: page-aligned, and on CUDA page-locked for exactly its size.

``torch.empty(pin_memory=True)`` goes through CUDA's caching host allocator, which rounds every
request up to a power of two and keeps freed blocks for reuse: an 8B-class model's 0.87 GB layer
would pin 1 GiB, its 2.1 GB embedding 4 GiB, the disk tier's cache up to twice its budget, and
nothing would count it. Here each buffer is an anonymous memory map (page-aligned; pages cost
nothing until touched) registered with ``cudaHostRegister`` for its exact size, and unregistered
when the last tensor viewing it is freed. Where registration fails (memlock limits) the buffer
stays pageable and one warning says so: copies are then slower, never wrong.
"""

from __future__ import annotations

import logging
import mmap
import threading
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

ALIGNMENT = 4096  # bytes; O_DIRECT needs page alignment of addresses, offsets and lengths

_lock = threading.Lock()
_pinned_bytes = 0
_warned = False


def pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def pinned_bytes() -> int:
    """Bytes of host memory this process has page-locked through :func:`host_empty` and not yet freed."""
    return _pinned_bytes


def _cudart() -> Any:
    return torch.cuda.cudart()


class _Mapping(mmap.mmap):
    """An anonymous mapping that, once registered with CUDA, unregisters itself when freed (it lives as
    long as any tensor viewing it: ``torch.frombuffer`` keeps it)."""

    address = 0
    pinned = 0

    def register(self, address: int) -> bool:
        global _pinned_bytes, _warned
        status = int(_cudart().cudaHostRegister(address, len(self), 0))
        if status != 0:
            with _lock:
                warn, _warned = not _warned, True
            if warn:
                log.warning(
                    f"megatrain: cannot page-lock host memory (cudaHostRegister error {status}; check "
                    "`ulimit -l`); using pageable memory, host-device copies will be slower."
                )
            return False
        self.address, self.pinned = address, len(self)
        with _lock:
            _pinned_bytes += self.pinned
        return True

    def __del__(self) -> None:
        global _pinned_bytes
        if self.pinned:
            _cudart().cudaHostUnregister(self.address)
            with _lock:
                _pinned_bytes -= self.pinned


def host_empty(numel: int, dtype: torch.dtype, pin_memory: bool = False) -> Tensor:
    """A 1-D host tensor starting on a page boundary, its memory a whole number of pages (so page-sized
    I/O into it stays inside it), page-locked for exactly those pages when ``pin_memory``."""
    nbytes = numel * dtype.itemsize
    mapping = _Mapping(-1, max(pages(nbytes), ALIGNMENT))
    memory = torch.frombuffer(mapping, dtype=torch.uint8)
    if pin_memory:
        mapping.register(memory.data_ptr())
    return memory[:nbytes].view(dtype)
