"""The disk tier's host cache: its entries, and which of them to evict to make room.

Each entry is a region of the cache arena holding one chunk of one kind of one block. Choosing what to
evict is Belady's rule over the arena's address range: the window of ``size`` bytes whose entries are all
idle and needed later than the one being admitted, the soonest needed of them as late as possible; then
clean (no write-back first), then small. :class:`megatrain_lightning.store.disk.DiskStore` calls these
with its lock held.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from torch import Tensor

from megatrain_lightning.store.arena import Arena

Key = tuple[int, str, int]  # (block, kind, chunk)
NEVER = float("inf")


@dataclass(eq=False)
class Entry:
    offset: int  # where its region starts in the cache arena
    raw: Tensor  # the region: page-aligned uint8, whole pages, what the I/O reads and writes
    buf: Tensor  # the typed view callers get
    holders: list[int] = field(default_factory=list)  # one thread id per pin
    dirty: bool = False
    ready: Future | None = None  # the load from disk
    writing: Future | None = None  # a write-back in flight
    ahead: bool = False  # read ahead, not pinned since

    @property
    def size(self) -> int:
        return self.raw.numel()

    @property
    def pins(self) -> int:
        return len(self.holders)

    @property
    def busy(self) -> bool:
        return self.loading or (self.writing is not None and not self.writing.done())

    @property
    def loading(self) -> bool:
        return self.ready is not None and not self.ready.done()


def failed(future: Future | None) -> bool:
    return future is not None and future.done() and future.exception() is not None


def best_window(
    arena: Arena,
    entries: dict[Key, Entry],
    rank_of: Callable[[Key], float],
    size: int,
    rank: float,
    keep: frozenset[Key],
    clean_only: bool = False,
    writing_ok: bool = True,
) -> tuple[int, list[tuple[Key, Entry]]] | None:
    """The ``size``-byte range of ``arena`` whose eviction hurts least (see the module docstring), as its
    start and the entries in it; ``None`` if every range holds an entry that may not leave: pinned,
    loading, in ``keep``, dirty when ``clean_only``, or needed no later than ``rank``. An entry being
    written back may if ``writing_ok``: the caller waits for the write rather than evict something
    needed sooner."""
    segments = sorted(
        [(start, end, None) for start, end in arena.gaps()]
        + [(e.offset, e.offset + e.size, (k, e)) for k, e in entries.items() if e.size],
        key=lambda segment: segment[0],
    )
    best, best_score = None, None
    for i, (start, _, _) in enumerate(segments):
        if start + size > arena.capacity:
            break
        victims = _evictable_from(segments, i, start + size, rank_of, rank, keep, clean_only, writing_ok)
        if victims is None:
            continue
        soonest = min((rank_of(k) for k, _ in victims), default=NEVER)
        clean = not any(e.dirty for _, e in victims)
        score = (soonest, clean, -sum(e.size for _, e in victims))
        if best_score is None or score > best_score:
            best, best_score = (start, victims), score
    return best


def _evictable_from(
    segments: list,
    first: int,
    end: int,
    rank_of: Callable[[Key], float],
    rank: float,
    keep: frozenset[Key],
    clean_only: bool,
    writing_ok: bool,
) -> list[tuple[Key, Entry]] | None:
    """The entries among ``segments[first:]`` that start before ``end``, or ``None`` if one may not leave."""
    victims = []
    for start, _, item in itertools.islice(segments, first, None):
        if start >= end:
            break
        if item is None:
            continue
        key, entry = item
        held = entry.pins or (entry.busy if not writing_ok else entry.loading) or key in keep
        held = held or (clean_only and entry.dirty)
        if held or rank_of(key) <= rank:
            return None
        victims.append(item)
    return victims
