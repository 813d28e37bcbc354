"""The store: the authoritative host copy of every block.

Each block owns one flat, page-aligned fp32 buffer of master weights (kind ``"param"``) and,
beside it, flat buffers of the same layout for gradients and optimizer state. Everything that
reads or writes a block's numbers goes through here, so a later tier (disk) only has to change
where these buffers live.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from megatrain_lightning.blocks import Block

log = logging.getLogger(__name__)

ALIGNMENT = 4096  # bytes; O_DIRECT needs page alignment


def aligned_empty(numel: int, dtype: torch.dtype, pin_memory: bool = False) -> Tensor:
    """A 1-D host tensor whose first byte is ``ALIGNMENT``-aligned."""
    nbytes = numel * dtype.itemsize
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=pin_memory)
    start = -raw.data_ptr() % ALIGNMENT
    return raw[start : start + nbytes].view(dtype)


class HostStore:
    """Per-block flat host buffers, by kind (``param``, ``grad``, ``exp_avg``, ...)."""

    def __init__(self, blocks: list[Block], pin_memory: bool = False) -> None:
        self.blocks = blocks
        self.pin_memory = pin_memory and self._can_pin()
        self._flat: dict[str, list[Tensor | None]] = {}
        self._views: dict[tuple[str, int], list[Tensor]] = {}
        for block in blocks:
            self.flat("param", block.index)

    @staticmethod
    def _can_pin() -> bool:
        try:
            torch.empty(1, pin_memory=True)
            return True
        except RuntimeError as err:  # memlock limits, no driver
            log.warning(
                f"megatrain: cannot pin host memory ({err}); using pageable memory, transfers will be slower."
            )
            return False

    def flat(self, kind: str, block: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """The flat buffer of ``kind`` for ``block``, allocated (zeroed, padding included) on first use."""
        buffers = self._flat.setdefault(kind, [None] * len(self.blocks))
        buf = buffers[block]
        if buf is None:
            buf = buffers[block] = aligned_empty(self.blocks[block].numel, dtype, self.pin_memory).zero_()
        return buf

    def has(self, kind: str, block: int) -> bool:
        return self._flat.get(kind, [None] * len(self.blocks))[block] is not None

    def views(self, kind: str, block: int) -> list[Tensor]:
        """Shaped views of each parameter of ``block`` into its ``kind`` buffer (cached)."""
        key = (kind, block)
        if key not in self._views:
            flat = self.flat(kind, block)
            self._views[key] = [
                flat[p.offset : p.offset + p.numel].view(p.shape) for p in self.blocks[block].params
            ]
        return self._views[key]

    def release(self, kind: str) -> None:
        """Free every buffer of ``kind``."""
        self._flat.pop(kind, None)
        for key in [k for k in self._views if k[0] == kind]:
            del self._views[key]

    def nbytes(self, *kinds: str) -> int:
        selected = kinds or tuple(self._flat)
        return sum(
            b.numel() * b.element_size() for k in selected for b in self._flat.get(k, ()) if b is not None
        )
