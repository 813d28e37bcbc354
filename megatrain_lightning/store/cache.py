"""The disk tier's host cache: its entries, and which of them to evict to make room.

Each entry is a region of the cache arena holding one chunk of one kind of one block. Choosing what to
evict is Belady's rule over the arena's address range: the window of ``size`` bytes whose entries are all
idle and needed later than the one being admitted, the soonest needed of them as late as possible; then
clean (no write-back first), then small. :class:`megatrain_lightning.store.disk.DiskStore` calls these
with its lock held.
"""

from __future__ import annotations

import collections
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
    size: int = field(init=False)  # bytes of ``raw`` (read on every eviction choice: a plain int)

    def __post_init__(self) -> None:
        self.size = self.raw.numel()

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
    needed sooner.

    Candidate ranges start where a gap or an entry starts. One pass slides the range over them (its end
    only moves forward), keeping the entries it covers as counts and a deque of their soonest uses: this
    runs on every admission to a full cache, so it is linear in the entries, not in entries x range."""
    segments = sorted(
        [(start, 0, None) for start, _ in arena.gaps()]
        + [(e.offset, e.size, (k, e)) for k, e in entries.items() if e.size],
        key=lambda segment: segment[0],
    )
    # Per segment: (held, dirty, size, next use); a gap is free room.
    facts = [
        (False, False, 0, NEVER)
        if item is None
        else _facts(*item, rank_of, rank, keep, clean_only, writing_ok)
        for _, _, item in segments
    ]
    best, best_score = None, None
    held = dirty = covered = 0  # over segments[first:last], the range's
    soonest: collections.deque[int] = collections.deque()  # indices in the range, their uses increasing
    last = 0
    for first, (start, _, _) in enumerate(segments):
        end = start + size
        if end > arena.capacity:
            break
        while last < len(segments) and segments[last][0] < end:
            is_held, is_dirty, nbytes, use = facts[last]
            held += is_held
            dirty += is_dirty
            covered += nbytes
            while soonest and facts[soonest[-1]][3] >= use:
                soonest.pop()
            soonest.append(last)
            last += 1
        if not held:
            score = (facts[soonest[0]][3] if soonest else NEVER, not dirty, -covered)
            if best_score is None or score > best_score:
                best, best_score = (start, first, last), score
        if first < last:  # the range moves past this segment
            is_held, is_dirty, nbytes, _ = facts[first]
            held -= is_held
            dirty -= is_dirty
            covered -= nbytes
            if soonest[0] == first:
                soonest.popleft()
    if best is None:
        return None
    start, first, last = best
    return start, [item for _, _, item in segments[first:last] if item is not None]


def _facts(
    key: Key,
    entry: Entry,
    rank_of: Callable[[Key], float],
    rank: float,
    keep: frozenset[Key],
    clean_only: bool,
    writing_ok: bool,
) -> tuple[bool, bool, int, float]:
    """Whether ``entry`` may not leave, whether it is dirty, its size and its next use."""
    use = rank_of(key)
    held = use <= rank or key in keep or bool(entry.holders) or (clean_only and entry.dirty)
    held = held or (entry.busy if not writing_ok else entry.loading)
    return held, entry.dirty, entry.size, use
