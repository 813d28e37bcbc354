"""One host buffer of fixed size, carved into page-aligned regions: the disk tier's cache memory.

Allocating a cache buffer per block and freeing it on eviction costs a fresh ``mmap`` and a page
fault per 4 KB on every reuse (gigabytes of first touches per step, and on CUDA a re-pinning);
carving regions out of one buffer touches each page once and bounds the cache exactly. Small
regions are placed from the top and large ones from the bottom, so the small ones (norms,
biases) do not split the space the large ones need.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

import torch
from torch import Tensor

from megatrain_lightning.store.memory import ALIGNMENT, host_empty

_SMALL = 1 << 20  # bytes; regions below this are placed from the top


def whole_pages_in(nbytes: int) -> int:
    """``nbytes`` rounded down to whole pages: an arena for a budget never exceeds it."""
    return nbytes // ALIGNMENT * ALIGNMENT


class Arena:
    """Regions of one page-aligned uint8 buffer of ``capacity`` bytes (pages untouched until used;
    all of them pinned at once on CUDA)."""

    def __init__(self, capacity: int, pin_memory: bool = False) -> None:
        self.capacity = whole_pages_in(capacity)
        self.memory = host_empty(self.capacity, torch.uint8, pin_memory)
        self.pinned = pin_memory and self.memory.is_pinned()  # False where page-locking failed
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []  # (start, end)
        self.used = 0

    def held(self) -> int:
        """Bytes of RAM the arena holds: all of it once page-locked, else the regions in use."""
        return self.capacity if self.pinned else self.used

    def allocate(self, size: int) -> int | None:
        """The offset of a free region of ``size`` (whole pages) bytes, or ``None`` if no gap fits."""
        if size == 0:
            return 0  # an empty region takes no space
        fits = [i for i, (start, end) in enumerate(self._free) if end - start >= size]
        if not fits:
            return None
        i = fits[-1] if size < _SMALL else fits[0]
        start, end = self._free[i]
        offset = end - size if size < _SMALL else start
        rest = [(s, e) for s, e in ((start, offset), (offset + size, end)) if e > s]
        self._free[i : i + 1] = rest
        self.used += size
        return offset

    def allocate_at(self, offset: int, size: int) -> None:
        """Take ``[offset, offset + size)``, which must be free (a window that eviction just emptied)."""
        i = bisect.bisect_right(self._free, (offset, self.capacity)) - 1
        start, end = self._free[i]
        assert start <= offset and offset + size <= end, "allocate_at: the window is not free"
        self._free[i : i + 1] = [(s, e) for s, e in ((start, offset), (offset + size, end)) if e > s]
        self.used += size

    def release(self, offset: int, size: int) -> None:
        """Return a region; it merges with free neighbours."""
        if size == 0:
            return
        i = bisect.bisect_left(self._free, (offset, offset))
        start, end = offset, offset + size
        if i < len(self._free) and self._free[i][0] == end:
            end = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == start:
            i -= 1
            start = self._free.pop(i)[0]
        self._free.insert(i, (start, end))
        self.used -= size

    def region(self, offset: int, size: int) -> Tensor:
        return self.memory[offset : offset + size]

    def gaps(self) -> Iterator[tuple[int, int]]:
        """Free ``(start, end)`` ranges in address order."""
        yield from self._free
