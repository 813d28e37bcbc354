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


def round_to_neighbour(
    y: Tensor, values: Tensor, u: Tensor, ascending: bool, log_octaves: float | None = None
) -> Tensor:
    """Sorted index (uint8) of ``y`` rounded to one of its two neighbouring ``values``, the farther one
    with probability ``distance / gap``: unbiased between the map's ends, ends kept as nearest rounding
    does (values beyond them go to the end; a value of the map encodes exactly). ``values`` ascending
    (m) or descending (v); in fp32 operations the kernel repeats. ``log_octaves`` (a log map of v whose
    neighbours lie that many octaves apart): the distance and gap of ``log2 y`` instead, so the stored
    value is unbiased in ``log v`` (:func:`exp2_of_fraction`)."""
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
    if log_octaves is None:
        up = (y - lower) > u * (upper - lower)
    else:  # log2(y / lower) > u * log_octaves
        up = y > lower * exp2_of_fraction(u, log_octaves)
    take_far = up if ascending else ~up
    return torch.where(take_far, nxt, index).to(torch.uint8)


# 2^f on [0, 1): 1 + f (c1 + f (c2 + f (c3 + f c4))), least squares in relative error; within 3.0e-6 of
# 2^f, 1 at f = 0, and 2^(octaves * u) stays below 2^octaves for every u (tests/test_codecs.py: all of them)
EXP2_POLY = tuple(
    map(float.fromhex, ("0x1p0", "0x1.62d6aap-1", "0x1.ee259ep-3", "0x1.abf51ap-5", "0x1.b7f614p-7"))
)


def exp2_of_fraction(u: Tensor, octaves: float) -> Tensor:
    """fp32 ``2^(octaves * u)`` for uniform numbers ``u``, in fp32 operations the kernel repeats (a power of
    two for the whole part of ``octaves * u``, a polynomial for the rest): the threshold of ``y / lower``
    above which log-domain stochastic rounding takes the upper neighbour."""
    x = u * octaves
    whole = torch.trunc(x)  # x >= 0: its floor
    frac = x - whole
    poly = torch.full_like(frac, EXP2_POLY[-1])
    for c in reversed(EXP2_POLY[:-1]):
        poly = poly * frac + c
    power = (whole.to(torch.int32) + 127).bitwise_left_shift_(23).view(torch.float32)
    return poly * power
