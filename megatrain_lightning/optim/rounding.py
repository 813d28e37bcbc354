"""Stochastic rounding of the low-bit codes: counter-based random numbers, the same in the C++ kernel.

Each number is a hash of (a stream's seed, the optimizer step, the element's index), with no global random
state, so a run draws the same numbers whatever its threads, chunks or timing, and a resumed run too.
"""

from __future__ import annotations

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF
_MIX = (0x7FEB352D, 0x2C1B3C6D)  # odd multipliers below 2^31: no int64 product of a 32-bit value overflows


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xor-shift, multiply) of int64 values below 2^32."""
    x = x ^ (x >> 16)
    x = (x * _MIX[0]) & _M32
    x = x ^ (x >> 15)
    x = (x * _MIX[1]) & _M32
    return x ^ (x >> 16)


def rounding_keys(seed: int, step: int) -> tuple[int, int]:
    """The 32-bit keys of m's and v's random numbers for one optimizer step of one stream (``seed``:
    e.g. a block's index): a function of its arguments only, so that a run (and a resumed one) draws
    the same numbers whatever the threads, chunks or timing."""
    base = _mix32(_mix32(torch.tensor(seed & _M32)) ^ (step & _M32))
    return int(_mix32(base ^ 1)), int(_mix32(base ^ 2))


def uniforms(start: int, n: int, key: int) -> Tensor:
    """fp32 numbers in [0, 1 - 2^-23], multiples of 2^-23, for the elements ``[start, start + n)`` of a
    stream: the top 23 bits of ``mix32(index ^ key)`` (the index's low 32 bits). One hash per number:
    the keys already differ per stream, step and moment."""
    index = torch.arange(start, start + n, dtype=torch.int64) & _M32
    return (_mix32(index ^ key) >> 9).to(torch.float32).mul_(2.0**-23)


def random_bits(u: Tensor, bits: int) -> Tensor:
    """int32 top ``bits`` (at most 23) of the hashes behind :func:`uniforms` ``u``: ``u`` truncated to a
    multiple of ``2^-bits``, times ``2^bits``. Added below a code's last kept bit, then truncated, they
    round it up with probability (its distance from the code below) / gap, in steps of ``2^-bits``."""
    return (u * 2.0**bits).to(torch.int32)


def round_to_neighbour(
    y: Tensor, values: Tensor, u: Tensor, ascending: bool, root_octaves: float | None = None
) -> Tensor:
    """Sorted index (uint8) of ``y`` rounded to one of its two neighbouring ``values``, the farther one
    with probability ``distance / gap``: unbiased between the map's ends, ends kept as nearest rounding
    does (values beyond them go to the end; a value of the map encodes exactly). ``values`` ascending
    (m) or descending (v); in fp32 operations the kernel repeats. ``root_octaves`` (a log map of v whose
    neighbours lie that many octaves apart): the distance and gap of ``y^(1/4)`` instead, so the stored
    value is unbiased in ``v^(1/4)`` (:func:`quarter_power_threshold`)."""
    levels = values.numel()
    # index: the values after the first on y's near side (m: <= y; v: > y), i.e. the near neighbour's
    if ascending:
        index = torch.bucketize(y, values[1:], right=True)
    else:
        index = torch.bucketize(y, values[1:].flip(0), right=True).neg_().add_(levels - 1)
    nxt = (index + 1).clamp_(max=levels - 1)
    near, far = values[index], values[nxt]
    # m: near <= y < far; v (descending): far <= y < near
    lower, upper = (near, far) if ascending else (far, near)
    if root_octaves is None:
        up = (y - lower) > u * (upper - lower)
    else:  # y^(1/4) - lower^(1/4) > u * (upper^(1/4) - lower^(1/4)), upper = lower * 2^root_octaves
        up = y > lower * quarter_power_threshold(u, root_octaves)
    take_far = up if ascending else ~up
    return torch.where(take_far, nxt, index).to(torch.uint8)


def quarter_root_step(octaves: float) -> float:
    """``2^(octaves / 4) - 1`` in fp32: how far apart the fourth roots of neighbours ``octaves`` apart lie,
    relative to the lower one's."""
    return float(torch.tensor(2.0 ** (octaves / 4) - 1, dtype=torch.float32))


def quarter_power_threshold(u: Tensor, octaves: float) -> Tensor:
    """fp32 ``(1 + u * (2^(octaves / 4) - 1))^4`` for uniform numbers ``u``, in the fp32 operations the kernel
    repeats (a multiply, an add, two squarings): the threshold of ``y / lower`` above which the upper
    neighbour is taken, so that the stored ``v^(1/4)`` is ``y^(1/4)`` in expectation."""
    w = u * quarter_root_step(octaves) + 1.0
    w = w * w
    return w * w
