"""What the disk tier's cache expects next: each chunk's rank (the trace's next use of its block and kind,
or before all of them, a claim by a submitted update), by which it evicts (Belady) and reads ahead."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from megatrain_lightning.store.cache import NEVER, Entry, Key
from megatrain_lightning.store.memory import pages

READ_AHEAD_CHUNKS = 2  # per I/O thread, unused: keeps the disk busy, evicts nothing kept for later uses


class ReadAhead:
    """Mixed into :class:`megatrain_lightning.store.disk.DiskStore`, which provides the lock (``_cond``),
    the cache (``_entries``, ``_arena``, ``_admit``, ``_size``), what is on disk (``_on_disk``), the chunking
    (``_chunks``), the I/O settings (``io``) and the count of demands waiting for room."""

    def _start_ranking(self) -> None:
        self._future: dict[tuple[int, str], int] = {}  # (block, kind) -> rank of its next predicted use
        self._predicted: list[tuple[int, str]] = []  # ``_future``'s keys, soonest first
        self._ahead = 0  # how far into ``_predicted`` everything on disk is cached (or was, when predicted)
        self._ahead_bytes = 0  # the cache room ``_predicted[:_ahead]`` was counted to need
        self._unused_ahead = 0  # bytes of the entries read ahead and not pinned since
        # Needed before anything the trace predicts (submitted updates), in order of submission.
        self._claimed: dict[Key, int] = {}
        self._claims = itertools.count()

    def hint(self, future: Iterable[tuple[int, tuple[str, ...]]]) -> None:
        """Rank every (block, kind) by its next predicted use; load ahead in that order while the cache
        has room that nothing needed sooner occupies."""
        with self._cond:
            self._future = {}
            for rank, (block, kinds) in enumerate(future):
                for kind in kinds:
                    self._future.setdefault((block, kind), rank)
            self._predicted = list(self._future)
            self._ahead = self._ahead_bytes = 0
            self._load_ahead()

    def claim(self, block: int, kinds: Iterable[str]) -> None:
        """``kinds`` of ``block`` are pinned next, chunk by chunk, before anything the trace predicts (a
        submitted update): load them as the cache allows and keep them until then."""
        with self._cond:
            for chunk in range(len(self._chunks[block])):
                for kind in kinds:
                    key = (block, kind, chunk)
                    self._claimed.pop(key, None)  # to the end: the dict stays in the order of its ranks
                    self._claimed[key] = self._claim_rank()
            self._load_ahead()

    def _rank(self, key: Key) -> float:
        claimed = self._claimed.get(key)
        return claimed if claimed is not None else self._future.get(key[:2], NEVER)

    def _claim_rank(self) -> int:
        return next(self._claims) - (1 << 62)  # below every trace position, in order of claiming (exact ints)

    def _load_ahead(self) -> None:
        """Load what is needed next, in rank order (claims, then the trace's predictions), while fewer than
        ``READ_AHEAD_CHUNKS`` per I/O thread wait unused and everything needed up to the chunk fits in the
        cache beside what is pinned: a chunk read ahead then stays until its use (whatever the cache evicts
        meanwhile is needed later), room stays for the sooner chunks that have no data on disk yet
        (gradient sums) or are not read yet, and what the cache keeps for later uses (the weights for the
        next pass, optimizer state for the next step) is evicted no earlier than a demand would."""
        window = READ_AHEAD_CHUNKS * self.io.threads * pages(self.io.chunk_bytes)
        if self._demands_waiting or self._unused_ahead >= window:
            return
        room = self._arena.capacity
        for key, entry in self._entries.items():
            room -= entry.size if entry.holders and key not in self._claimed else 0

        def fetch(key: Key) -> bool:
            """Read ``key`` ahead if it is on disk and not cached, evicting only what is needed later;
            whether the walk goes on."""
            if key in self._entries or key not in self._on_disk:
                return True
            return self._unused_ahead < window and self._admit(key, demand=False) is not None

        for key in self._claimed:  # in the order of their ranks
            room -= self._size(key)
            if room < 0 or not fetch(key):
                return
        room -= self._ahead_bytes
        while self._ahead < len(self._predicted):
            block, kind = self._predicted[self._ahead]
            counted = 0
            for chunk in range(len(self._chunks[block])):
                key = (block, kind, chunk)
                if key in self._claimed:
                    continue
                counted += self._size(key)
                if counted > room or not fetch(key):
                    return
            room -= counted
            self._ahead_bytes += counted
            self._ahead += 1

    def _used(self, entry: Entry) -> None:
        """``entry`` is pinned or leaves: no longer read ahead and waiting unused."""
        if entry.ahead:
            entry.ahead = False
            self._unused_ahead -= entry.size
