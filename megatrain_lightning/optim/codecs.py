"""Block-wise absmax codecs for compressed Adam moments (int8/int4/int3/int2), apart from the optimizer.

A *format* (``FORMATS``, keyed by the mode's average bits per moment) gives each moment a code width, a
block size and a map; every value decodes as ``table[code] * scale``, one fp32 scale per block:

======  =================================================  =================================================
format  m (first moment)                                   v (second moment)
======  =================================================  =================================================
int8    8 bits, signed E4M3 (sign + 4-bit exponent +       8 bits, logarithmic without zero: code c ->
        3-bit mantissa, subnormals, no inf/NaN): a          2^(-c/16) (256 values, 16 octaves in
        dynamic-exponent map spanning 1.875 .. 2^-17;       1/16-octave steps); blocks of 128,
        blocks of 256, scale = absmax / 1.875               scale = max(absmax, 2^-100)
int4    4 bits, the 16-value dynamic-exponent map of Li     4 bits, logarithmic without zero: code c ->
        et al. 2023 (0, +-.0055, +-.0325, +-.0775, +-.2125,  2^(-c/2) (16 values, 7.5 octaves);
        +-.4375, +-.6625, +-.8875, +1); blocks of 64,       blocks of 128, scale = max(absmax, 2^-100)
        scale = *signed* absmax (the sign of the largest
        element, so it maps to +1)
int3    as int4 (4 bits)                                    2 bits, logarithmic: c -> 2^(-2c) (4 values,
                                                            6 octaves); blocks of 64; stochastic rounding
                                                            unbiased in v^(1/4)
int2    2 bits: -0.5, 0, 0.5, 1; blocks of 32, signed       as int3
        absmax
======  =================================================  =================================================

Why these (measured on real gradients by ``benchmarks/codec_candidates.py``, table in
``benchmarks/RESULTS.md``): what the update uses is ``m / sqrt(v)``, so v needs *relative* precision
over a wide range; a linear v map lifts every element below 1/32 of its block's max to 1/16 of it,
which shrinks those updates by up to 4x, while the logarithmic map keeps every element within
``2^(step/2)`` of its value over 7.5 octaves. int8's v had a linear map too (format versions 1 and 2),
which lifts every v below 1/256 of its block's max to that: with both moments stored, int8's update
error is 0.147 with it and 0.079 with the 8-bit log map. The first moment is signed and well served by Li
et al.'s map; smaller blocks cut its error further for 1/16 byte per parameter.

Rounding is chosen by the update's *bias*, not by its RMS error alone (figures in RESULTS.md): rounded to
nearest, a moment stays on its code while each step moves it by less than half a code, so a steady small
gradient's update is damped (table formats 0.87x as far as fp32 AdamW, int2 0.57x) and a stopped gradient's v
stands (10 steps of beta2 0.95 later: 2-bit v 1.85x fp32's, int8 1.20x). So int4 and int3 round their 4-bit m
stochastically, and int8 its E4M3 m (to nearest, an m whose gradients stay within 30-60% of it stays on its
code, up to 6% off: its update's gain with m alone stored, real gradients: 0.997, stochastic 1.000); int2
rounds m to nearest (a small m drawn up to 1/2 of the block max kicks its weight by many steps' worth). Every
format rounds v stochastically: int8 and int4 unbiased in v, and 2-bit v (int3, int2) unbiased in ``v^(1/4)``
(to the upper neighbour with probability ``(y^(1/4) - lower^(1/4)) / (upper^(1/4) - lower^(1/4))``). Why the
fourth root: v is an average re-encoded every step, so what its rounding is unbiased in sets where v settles,
and with codes 4x apart that is far from fp32's v. Unbiased in v, v settles where its mean is right but
``1 / sqrt(v)`` is high (Jensen): noisy gradients' updates overstep by 1.2-1.3x. Unbiased in ``log v``, v
settles where the mean of ``1 / v`` is right, so ``1 / sqrt(v)`` is low: the update is damped (gain 0.91 on
real gradients, 0.94-0.98 for a steady gradient between two codes). Unbiased in ``v^(1/4)``, the steady
gradient's update is within 0.4% of fp32's wherever it lies between the codes (real gradients: gain 0.97).

Codes are uint8 bytes holding 8 / width codes each, element ``k`` of byte ``j`` in bits
``[k * width, (k + 1) * width)`` (so for 4 bits element ``2j`` is the low nibble); a partial last byte
leaves its unused bits 0.

Encoding rounds to the nearest code (ties: half to even for E4M3, down for the first-moment tables; the
log maps compare with the geometric means of neighbouring values), or, for the moments a format names in
``Format.stochastic`` (every format's m but int2's, every format's v) or a caller asks for,
*stochastically*: to one of the two neighbouring values, the farther with probability distance / gap (of
``v^(1/4)`` where ``Format.v_root_rounding``), so that the stored value is unbiased (between the map's ends)
and a slow average is not stuck on its code when each step moves it by less than half a code. The random
numbers are counter-based (``uniforms``: a 32-bit hash of the element's index in its stream and a key of
the stream's seed and the optimizer step), so a run is
reproducible and independent of how the stream is cut into slices or threads, and a resumed run draws
the same numbers. Stochastic rounding changes the encoder only: the codes decode as before. Inputs are
cleaned first, so no NaN or Inf ever comes out: NaN encodes as 0, +-Inf and magnitudes above ``CLAMP``
(FLT_MAX less 2 ulp) as +-CLAMP, and v's negative values and -0.0 as 0. A power-of-two pre-scale keeps
``1 / absmax`` finite for subnormal blocks. The second moment's block max never drops below ``V_FLOOR``,
so once written v never decodes to 0 (its square root is far below any Adam eps); a zero-filled state
(all codes and scales 0) decodes to exactly 0, the fresh-optimizer state.

Error bounds per element x of a block whose cleaned absmax is A (checked by tests/test_codecs.py;
``error_bound`` computes them), with ``tiny = 2^-148`` covering subnormal decode rounding:

* m, int8: ``|dec - x| <= 2^-4 * |x| * (1 + 2^-12) + 2^-18 / 1.875 * A + tiny`` (3 significant
  bits relative, absolute ``2.0e-6 * A`` below the smallest normal); in particular ``<= A / 30``.
* m, table maps: ``|dec - x| <= g * A * (1 + 2^-12) + tiny`` with g the larger of half the largest gap
  of the map and its distance from -1 (0.1125 for 4 bits, 0.5 for 2); the element of largest magnitude
  decodes exactly.
* v, log map with step ``r`` octaves over ``L`` codes, ``S = max(A, 2^-100)``, ``lo = S * 2^(-r(L-1))``:
  ``|dec - x| <= (2^(r/2) - 1) * x * (1 + 2^-12)`` for ``x >= lo`` and ``dec = lo`` below; ``dec > 0``.
* Stochastic rounding: the whole gap instead of half of it (m, int8: twice its bound; table maps: the
  largest gap of the map, or the distance from -1; v: ``(2^r - 1) * x``); values of the map encode exactly.

The log maps' values and thresholds repeat per octave exactly (powers of two times those of one octave),
so the C++ kernel keeps one octave and shifts exponents. The fused step (``quantized.py``) uses exactly
these codecs; its C++ kernel and torch fallback agree with this module bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from megatrain_lightning.optim import packing, rounding
from megatrain_lightning.store.layout import ALIGN

Kind = Literal["m", "v"]

M8_TOP = 1.875  # largest E4M3 magnitude
M8_MIN_NORMAL = 2.0**-14
V_FLOOR = 2.0**-100
CLAMP = float(torch.tensor(0x7F7FFFFD, dtype=torch.int32).view(torch.float32))
_TINY = 2.0**-148
_PRE_LO, _PRE_HI = 2.0**-64, 2.0**64

# first-moment maps by code width, sorted ascending (the largest is +1: the signed block max)
M_SORTED = {
    4: (-0.8875, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055, 0.0,
        0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0),
    2: (-0.5, 0.0, 0.5, 1.0),
}  # fmt: skip


@dataclass(frozen=True)
class Format:
    """One compression mode: per moment a code width, elements per scale and a map."""

    name: str
    m_bits: int
    m_block: int
    v_bits: int
    v_block: int
    v_octaves: float  # the log map's step (octaves per code)
    stochastic: tuple[Kind, ...] = ()  # moments the fused step encodes with stochastic rounding
    v_root_rounding: bool = False  # v rounded stochastically is unbiased in v^(1/4) (else in v)

    @property
    def m_sorted(self) -> Tensor:
        return torch.tensor(M_SORTED[self.m_bits], dtype=torch.float32)

    @property
    def m_zero(self) -> int:
        """Sorted index of 0.0: the code of sorted index i is ``(i - m_zero) mod 2^m_bits``."""
        return M_SORTED[self.m_bits].index(0.0)

    @property
    def m_midpoints(self) -> Tensor:
        t = self.m_sorted
        return (t[:-1] + t[1:]) * 0.5  # float32 arithmetic, as the C++ kernel

    @property
    def m_table(self) -> Tensor:
        """Value by code (code 0 is 0.0)."""
        levels = 1 << self.m_bits
        return self.m_sorted[(torch.arange(levels) + self.m_zero) % levels]

    @property
    def v_table(self) -> Tensor:
        """Log map: value by code, descending from 1 (code 0)."""
        return _log_map(torch.arange(1 << self.v_bits), self.v_octaves)

    @property
    def v_thresholds(self) -> Tensor:
        """Log map: the geometric means of neighbouring values; the code is the count of those above y."""
        return _log_map(torch.arange((1 << self.v_bits) - 1) + 0.5, self.v_octaves)


def _log_map(steps: Tensor, octaves: float) -> Tensor:
    """fp32 ``2^(-step * octaves)``, as a power of two times the value of its place in its octave (rounded
    once): the values repeat per octave exactly, as the kernel's one-octave tables need."""
    exponent = steps.double() * octaves
    whole = torch.floor(exponent)
    return torch.exp2(whole - exponent).float() * torch.exp2(-whole).float()


FORMATS = {
    8: Format("int8", 8, 256, 8, 128, 1 / 16, stochastic=("m", "v")),
    4: Format("int4", 4, 64, 4, 128, 0.5, stochastic=("m", "v")),
    3: Format("int3", 4, 64, 2, 64, 2.0, stochastic=("m", "v"), v_root_rounding=True),
    2: Format("int2", 2, 32, 2, 64, 2.0, stochastic=("v",), v_root_rounding=True),  # stochastic m: -4% loss
}
FORMAT_VERSION = 3  # of the stored codes; 1 and 2: int8's v on a linear map (upgrade_v8), 1: int4 with
# blocks of 128 and a linear v map (issue 4)


def _e4m3_table() -> Tensor:
    values = []
    for code in range(256):
        mag = code & 127
        exponent, mantissa = mag >> 3, mag & 7
        value = mag * 2.0**-17 if exponent == 0 else 2.0 ** (exponent - 15) * (1 + mantissa / 8)
        values.append(-value if code & 128 else value)  # code 128 is -0.0 (never produced)
    return torch.tensor(values, dtype=torch.float32)


M8_TABLE = _e4m3_table()  # by code, exact


def _check(kind: str, bits: int) -> Format:
    if kind not in ("m", "v"):
        raise ValueError(f"kind must be 'm' or 'v', got {kind!r}")
    if bits not in FORMATS:
        raise ValueError(f"bits must be one of {tuple(FORMATS)}, got {bits!r}")
    return FORMATS[bits]


def width(kind: Kind, bits: int) -> int:
    """Bits per code of one moment."""
    fmt = _check(kind, bits)
    return fmt.m_bits if kind == "m" else fmt.v_bits


def block_size(kind: Kind, bits: int) -> int:
    """Elements per scale."""
    fmt = _check(kind, bits)
    return fmt.m_block if kind == "m" else fmt.v_block


def code_bytes(numel: int, kind: Kind, bits: int) -> int:
    """Bytes of codes for ``numel`` elements of one moment."""
    return -(-numel * width(kind, bits) // 8)


def num_scales(numel: int, kind: Kind, bits: int) -> int:
    """fp32 scales for ``numel`` elements (one moment)."""
    return -(-numel // block_size(kind, bits))


def state_bytes(numel: int, bits: int) -> int:
    """Bytes of m and v with their scales for ``numel`` elements: about 2.05 (int8), 1.09 (int4), 0.88
    (int3) and 0.69 (int2) bytes per element, against 8 for fp32 moments."""
    return sum(code_bytes(numel, k, bits) + 4 * num_scales(numel, k, bits) for k in ("m", "v"))


def state_slices(a: int, b: int, bits: int) -> tuple[slice, slice, slice, slice]:
    """``(m_codes, m_scales, v_codes, v_scales)`` index ranges of elements ``[a, b)`` of a flat buffer, for
    slicing the state of the whole buffer; ``a`` must be a multiple of ``ALIGN``."""
    _check("m", bits)
    if a % ALIGN or not 0 <= a <= b:
        raise ValueError(f"a slice must start at a multiple of {ALIGN} and not end before it; got [{a}, {b})")
    out = []
    for kind in ("m", "v"):
        w, size = width(kind, bits), block_size(kind, bits)
        out += [slice(a * w // 8, -(-b * w // 8)), slice(a // size, -(-b // size))]
    return tuple(out)  # type: ignore[return-value]


def empty_state(
    numel: int, bits: int, device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Zeroed ``(m_codes, m_scales, v_codes, v_scales)``: decodes to m = v = 0 (a fresh optimizer)."""
    return tuple(
        torch.zeros(count(numel, kind, bits), dtype=dtype, device=device)
        for kind in ("m", "v")
        for count, dtype in ((code_bytes, torch.uint8), (num_scales, torch.float32))
    )  # type: ignore[return-value]


# -- block encoders / decoders on [blocks, B] tensors (shared with the torch fallback) --


def _f32(value: float, like: Tensor) -> Tensor:
    return torch.full((), value, dtype=torch.float32, device=like.device)


def _prescale(absmax: Tensor) -> Tensor:
    """Power-of-two factor keeping ``absmax * pre`` within [2^-64, 2^64] (exact scaling)."""
    one = torch.ones_like(absmax)
    pre = torch.where(absmax < _PRE_LO, one * _PRE_HI, one)
    return torch.where(absmax > _PRE_HI, one * _PRE_LO, pre)


def clean_m(x: Tensor) -> Tensor:
    """NaN -> 0, magnitudes clamped to ``CLAMP`` (infinities included)."""
    return torch.nan_to_num(x, nan=0.0).clamp_(-CLAMP, CLAMP)


def clean_v(x: Tensor) -> Tensor:
    """NaN and negative values -> 0, values clamped to ``CLAMP``."""
    return torch.fmax(x, torch.zeros((), dtype=x.dtype)).clamp_(max=CLAMP)


def _needs_cleaning(absmax: Tensor) -> bool:
    return not bool(((absmax <= CLAMP) & ~torch.isnan(absmax)).all())


def encode_m_blocks(x: Tensor, bits: int, u: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """fp32 ``[blocks, B]`` -> (uint8 codes ``[blocks, B]`` unpacked, fp32 scales ``[blocks]``).
    Cleans the input (``clean_m``) first when it holds NaN, Inf or magnitudes above ``CLAMP``. With
    ``u`` (:func:`uniforms`, shaped like ``x``), rounds stochastically."""
    a = x.abs()
    absmax = a.amax(dim=1)
    if _needs_cleaning(absmax):
        x = clean_m(x)
        a = x.abs()
        absmax = a.amax(dim=1)
    pre = _prescale(absmax)
    zero = absmax == 0
    if bits == 8:
        inv = torch.where(zero, torch.zeros_like(absmax), _f32(M8_TOP, x) / (absmax * pre))
        scales = absmax / M8_TOP
        z = a.mul_(pre[:, None]).mul_(inv[:, None])
        zb = z.view(torch.int32)
        if u is None:  # to nearest, half to even
            code = ((zb >> 20) & 1).add_(zb).add_(0x7FFFF - (896 << 20)) >> 20
            sub = (z + 64.0).view(torch.int32) - 0x42800000  # bits of 64.0: round(z * 2^17), half to even
        else:  # plus 20 random bits (a fraction of the gap), truncated: up with probability distance / gap
            r = rounding.random_bits(u, 20)
            code = ((zb + r) >> 20) - 896
            sub = ((z.clamp(max=M8_MIN_NORMAL) * 2.0**37).to(torch.int32) + r) >> 20  # z * 2^17 codes
        code = torch.where(z < M8_MIN_NORMAL, sub, code).clamp_(max=127)
        code = torch.where(torch.signbit(x) & (code != 0), code | 128, code)
        return code.to(torch.uint8), scales
    fmt = FORMATS[bits]
    levels = 1 << fmt.m_bits
    positive = x.clamp(min=0).amax(dim=1)
    signed = torch.where(positive >= absmax, absmax, -absmax)
    inv = torch.where(zero, torch.zeros_like(absmax), _f32(1.0, x) / (signed * pre))
    y = (x * pre[:, None]).mul_(inv[:, None])
    if u is not None:
        index = rounding.round_to_neighbour(y, fmt.m_sorted, u, ascending=True)
        return index.add_(levels - fmt.m_zero).bitwise_and_(levels - 1), signed
    index = torch.full(y.shape, levels - fmt.m_zero, dtype=torch.uint8)  # midpoints below y, + offset
    above = torch.empty(y.shape, dtype=torch.bool)
    for t in fmt.m_midpoints.tolist():
        index += torch.gt(y, t, out=above)
    return index.bitwise_and_(levels - 1), signed


def decode_m_blocks(codes: Tensor, scales: Tensor, bits: int) -> Tensor:
    """uint8 codes ``[blocks, B]`` (unpacked) and scales ``[blocks]`` -> fp32 ``[blocks, B]``."""
    table = (M8_TABLE if bits == 8 else FORMATS[bits].m_table).to(codes.device)
    return table[codes.long()] * scales[:, None]


def encode_v_blocks(x: Tensor, bits: int, u: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """fp32 ``[blocks, B]`` -> (uint8 codes unpacked, fp32 scales ``[blocks]``). Cleans the input
    (``clean_v``) first when it holds NaN, Inf, negative values or magnitudes above ``CLAMP``. With
    ``u``, rounds stochastically."""
    absmax = x.amax(dim=1)
    if _needs_cleaning(absmax) or (x.numel() and not bool(x.amin() >= 0)):
        x = clean_v(x)
        absmax = x.amax(dim=1)
    absmax = absmax.clamp_(min=V_FLOOR)
    fmt = FORMATS[bits]
    inv = _f32(1.0, x) / absmax
    y = x * inv[:, None]
    if u is not None:
        root_octaves = fmt.v_octaves if fmt.v_root_rounding else None
        code = rounding.round_to_neighbour(y, fmt.v_table, u, ascending=False, root_octaves=root_octaves)
        return code, absmax
    ascending = fmt.v_thresholds.flip(0)  # the code: how many thresholds lie above y
    code = torch.bucketize(y, ascending, right=True).neg_().add_(ascending.numel())
    return code.to(torch.uint8), absmax


def decode_v_blocks(codes: Tensor, scales: Tensor, bits: int) -> Tensor:
    return FORMATS[bits].v_table.to(codes.device)[codes.long()] * scales[:, None]


def upgrade_v8(codes: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """int8's v stored in format versions 1 and 2 (linear map: code c -> (c + 1) / 256 of the block max,
    scale = max / 256) in today's log map, rounded to the nearest code: a resumed run goes on from its
    moments within the log map's error. Blocks never written (scale 0) stay zero, the fresh state."""
    numel = codes.numel()
    old = (_blocks(codes, 128).to(torch.int32) + 1).to(torch.float32) * scales.reshape(-1, 1)
    new_codes, new_scales = quantize(old.reshape(-1)[:numel], "v", 8)
    fresh = scales.reshape(-1) == 0
    new_scales[fresh] = 0.0
    new_codes[fresh.repeat_interleave(128)[:numel]] = 0
    return new_codes, new_scales


# -- public codec --


def _blocks(x: Tensor, size: int) -> Tensor:
    pad = -x.numel() % size
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, size)


def quantize(x: Tensor, kind: Kind, bits: int, key: int | None = None) -> tuple[Tensor, Tensor]:
    """Any-shaped float tensor -> ``(codes uint8 [code_bytes(numel)], scales fp32 [num_scales])``;
    rounded stochastically with the numbers ``rounding.uniforms(0, numel, key)``
    when ``key`` is given (the log maps of v, the table maps of m), to the nearest code otherwise."""
    _check(kind, bits)
    flat = x.detach().reshape(-1).to(torch.float32)
    numel = flat.numel()
    encode = encode_m_blocks if kind == "m" else encode_v_blocks
    blocks = _blocks(flat, block_size(kind, bits))
    u = None
    if key is not None:
        u = rounding.uniforms(0, blocks.numel(), key).view(blocks.shape)
    codes, scales = encode(blocks, bits, u)
    return packing.pack(codes.reshape(-1)[:numel], width(kind, bits)), scales


def dequantize(codes: Tensor, scales: Tensor, kind: Kind, bits: int, numel: int) -> Tensor:
    """Inverse of :func:`quantize`: fp32 ``[numel]``."""
    _check(kind, bits)
    if codes.numel() != code_bytes(numel, kind, bits) or scales.numel() != num_scales(numel, kind, bits):
        raise ValueError(
            f"{numel} elements need {code_bytes(numel, kind, bits)} code bytes and "
            f"{num_scales(numel, kind, bits)} scales; got {codes.numel()} and {scales.numel()}"
        )
    blocks = _blocks(packing.unpack(codes.reshape(-1), numel, width(kind, bits)), block_size(kind, bits))
    decode = decode_m_blocks if kind == "m" else decode_v_blocks
    return decode(blocks, scales.reshape(-1).to(torch.float32), bits).reshape(-1)[:numel]


def error_bound(x: Tensor, kind: Kind, bits: int, stochastic: bool = False) -> Tensor:
    """The per-element bound on ``|dequantize(quantize(x)) - clean(x)|`` stated in the module docstring;
    ``stochastic``: of a table format rounded stochastically (``quantize(..., key=...)``)."""
    fmt = _check(kind, bits)
    flat = x.detach().reshape(-1).to(torch.float32)
    numel = flat.numel()
    clean = clean_m(flat) if kind == "m" else clean_v(flat)
    blocks = _blocks(clean, block_size(kind, bits)).double()
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    slack = 1 + 2.0**-12
    if kind == "m" and bits == 8:  # half the gap of E4M3's values (stochastically: all of it)
        bound = (2.0**-4 * blocks.abs() * slack + 2.0**-18 / M8_TOP * absmax) * (1 + stochastic) + _TINY
    elif kind == "m":
        bound = (max_relative_error(kind, bits, stochastic) * slack) * absmax + _TINY + blocks * 0
    else:
        lo = absmax.clamp(min=V_FLOOR) * float(fmt.v_table[-1])
        step = fmt.v_octaves if stochastic else fmt.v_octaves / 2
        bound = torch.where(blocks >= lo, (2**step - 1) * blocks * slack + _TINY, lo * slack)
    return bound.reshape(-1)[:numel]


def max_relative_error(kind: Kind, bits: int, stochastic: bool = False) -> float:
    """The worst error as a fraction of the block absmax (the constant in the bounds above); rounded
    stochastically, the error reaches the whole gap between neighbouring values."""
    fmt = _check(kind, bits)
    if kind == "m":
        if bits == 8:
            return 1 / 15 if stochastic else 1 / 30
        t = fmt.m_sorted  # half the largest gap (SR: all of it), or the distance from -1 to the lowest value
        return max(float((t[1:] - t[:-1]).max()) / (1 if stochastic else 2), 1 + float(t[0]))
    return 2 ** (fmt.v_octaves / (1 if stochastic else 2)) - 1


__all__ = [
    "ALIGN",
    "CLAMP",
    "FORMATS",
    "FORMAT_VERSION",
    "M8_TABLE",
    "V_FLOOR",
    "Format",
    "block_size",
    "code_bytes",
    "dequantize",
    "empty_state",
    "error_bound",
    "max_relative_error",
    "num_scales",
    "quantize",
    "state_bytes",
    "state_slices",
    "upgrade_v8",
    "width",
]
