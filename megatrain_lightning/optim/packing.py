"""Codes below ``2^width`` packed ``8 / width`` to a byte, the layout the fused kernel reads and writes."""

from __future__ import annotations

import torch
from torch import Tensor


def pack(codes: Tensor, width: int) -> Tensor:
    """uint8 codes below ``2^width`` -> ``8 / width`` per byte, element k of a byte in bits
    ``[k * width, (k + 1) * width)``; a partial last byte is zero-padded."""
    codes = codes.reshape(-1)
    if width == 8:
        return codes.clone()
    per = 8 // width
    pad = -codes.numel() % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    groups = codes.view(-1, per)
    out = groups[:, 0].clone()
    for k in range(1, per):
        out |= groups[:, k] << (k * width)
    return out


def unpack(packed: Tensor, numel: int, width: int) -> Tensor:
    """Inverse of :func:`pack`: ``numel`` uint8 codes."""
    if width == 8:
        return packed.reshape(-1)[:numel]
    mask = (1 << width) - 1
    parts = [(packed >> (k * width)) & mask for k in range(8 // width)]
    return torch.stack(parts, dim=1).reshape(-1)[:numel]
