"""Where each parameter lives in its block's flat buffers (every kind of the store shares the layout).

Large parameters come first and small ones (under ``SMALL_PARAM`` elements: norms, biases) after
``large_numel``, each starting on an ``ALIGN``-element boundary, so that block-wise quantized
optimizer state covers whole parameters and small ones can keep fp32 state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatrain_lightning.engine.blocks import CallSite

ALIGN = 256  # elements; a multiple of every quantization block size
SMALL_PARAM = 4096
CHUNK_NUMEL = 4 << 20  # elements (16 MB of fp32): the store's unit of caching, I/O and update


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def chunk_numel_for(chunk_bytes: int) -> int:
    """Elements per chunk for a chunk of about ``chunk_bytes`` of fp32: whole ``ALIGN``s (so block-wise
    quantized state splits at chunk borders exactly as a whole block's does), at least one."""
    return max(ALIGN, chunk_bytes // 4 // ALIGN * ALIGN)


def chunk_spans(numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    """``[0, numel)`` cut into consecutive ranges of ``chunk_numel`` (the last one shorter)."""
    return [(start, min(start + chunk_numel, numel)) for start in range(0, numel, chunk_numel)] or [(0, 0)]


@dataclass(frozen=True)
class ParamSpec:
    """Where one parameter lives inside its block's flat buffer."""

    name: str
    shape: torch.Size
    offset: int
    numel: int
    requires_grad: bool


@dataclass(eq=False)
class Block:
    """A paging unit: its parameters, their flat layout and the call sites that use them."""

    index: int
    name: str
    params: list[ParamSpec] = field(default_factory=list)
    sites: list[CallSite] = field(default_factory=list)
    numel: int = 0  # length of the flat buffer, padding included
    large_numel: int = 0  # where the small parameters begin
    repeated: bool = False  # an instance of a block class (a decoder layer), not embeddings/head

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's shaped view into a flat buffer of this block's layout."""
        return [flat[p.offset : p.offset + p.numel].view(p.shape) for p in self.params]
