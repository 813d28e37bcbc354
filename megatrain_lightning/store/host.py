"""The store: the authoritative host copy of every block.

Each block owns one flat, page-aligned fp32 buffer of master weights (kind ``"param"``) and,
beside it, flat buffers of the same layout for gradients and optimizer state (other kinds).
Everything that reads or writes a block's numbers goes through ``pinned``, so the disk tier
(:class:`megatrain_lightning.store.disk.DiskStore`) only changes where these buffers live and when
they move. In this host tier every buffer stays in RAM for the store's whole life.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor

from megatrain_lightning.engine.chaos import point
from megatrain_lightning.store.layout import Block
from megatrain_lightning.store.memory import host_empty
from megatrain_lightning.telemetry.stats import EngineStats

log = logging.getLogger(__name__)


class HostStore:
    """Per-block flat host buffers by kind (``param``, ``grad``, ``exp_avg``, ...), all in RAM."""

    drops_discarded = False  # whether ``discard`` loses the contents (the disk tier's cache does)

    def __init__(
        self, blocks: list[Block], pin_memory: bool = False, stats: EngineStats | None = None
    ) -> None:
        self.blocks = blocks
        self.pin_memory = pin_memory
        self.stats = stats or EngineStats()
        self._buffers: dict[tuple[int, str], Tensor] = {}
        self._kinds: dict[str, tuple[torch.dtype, Callable[[Block], int]]] = {}
        self._lock = threading.Lock()

    def define_kind(self, kind: str, dtype: torch.dtype, numel: Callable[[Block], int]) -> None:
        """Buffers of ``kind`` hold ``numel(block)`` elements of ``dtype`` (default: fp32, block layout)."""
        self._kinds[kind] = (dtype, numel)

    def layout(self, block: int, kind: str) -> tuple[torch.dtype, int]:
        dtype, numel = self._kinds.get(kind, (torch.float32, lambda b: b.numel))
        return dtype, numel(self.blocks[block])

    @contextlib.contextmanager
    def pinned(self, block: int, kind: str, write: bool = False) -> Iterator[Tensor]:
        """The flat buffer of ``kind`` for ``block`` (zeros until first written), held for the context."""
        point("store.pin")
        yield self._buffer(block, kind)

    @contextlib.contextmanager
    def pinned_all(
        self, block: int, kinds: Iterable[str], write: bool = False
    ) -> Iterator[dict[str, Tensor]]:
        """``pinned`` for several kinds of ``block`` at once (what an update uses), by kind."""
        with contextlib.ExitStack() as stack:
            yield {kind: stack.enter_context(self.pinned(block, kind, write)) for kind in kinds}

    def read(self, block: int, kind: str) -> Tensor:
        """The current contents, for callers that keep them (state dicts): the buffer itself here."""
        return self._buffer(block, kind)

    def written(self, block: int, kinds: Iterable[str]) -> None:
        """``kinds`` of ``block`` changed outside ``pinned(write=True)`` bookkeeping (nothing to do here)."""

    def discard(self, block: int, kind: str) -> None:
        """The contents of ``kind`` are no longer needed (a consumed gradient): kept allocated here."""

    def hint(self, future: Iterable[tuple[int, tuple[str, ...]]]) -> None:
        """The predicted coming accesses, in order, each a block and the kinds it will use; a tier
        with a cache ranks what it holds by them and loads ahead."""

    def claim(self, block: int, kinds: Iterable[str]) -> None:
        """``kinds`` of ``block`` are pinned next, ahead of every predicted access (a submitted update)."""

    def nbytes(self, *kinds: str) -> int:
        """Bytes of host memory the store holds (for ``kinds``, or all)."""
        return sum(
            b.numel() * b.element_size() for (_, k), b in self._buffers.items() if not kinds or k in kinds
        )

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
