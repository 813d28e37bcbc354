"""Block-wise absmax codecs for compressed Adam moments (int8 / int4), separate from the optimizer.

Formats (every value decodes as ``table[code] * scale``, one fp32 scale per block):

=======  =====  ==========================================================  ======================
moment   bits   map (code -> table value)                                   block / scale
=======  =====  ==========================================================  ======================
m        8      signed E4M3 (sign bit + 4-bit exponent + 3-bit mantissa,    256 elements,
                with subnormals; no inf/NaN): a dynamic-exponent map         scale = absmax / 1.875
                spanning 1.875 .. 2^-17 (5.4 decades, 3 significant bits)
m        4      the 16-value dynamic-exponent map of Li et al. 2023          128 elements,
                (bitsandbytes' ``create_dynamic_map(total_bits=4)``):        scale = *signed* absmax
                0, +-.0055, +-.0325, +-.0775, +-.2125, +-.4375, +-.6625,     (the sign of the largest
                +-.8875, +1; code 0 is 0.0                                   element, so it maps to +1)
v        8 / 4  unsigned linear without zero: code c -> (c + 1) / 2^bits    128 elements,
                                                                             scale = max(absmax, 2^-100)
                                                                             / 2^bits
=======  =====  ==========================================================  ======================

Codes are uint8, one per element for 8 bits; for 4 bits two per byte, element ``2j`` in the low
nibble of byte ``j`` and ``2j + 1`` in the high one (odd lengths leave the last high nibble 0).

Encoding rounds to the nearest code (ties: half to even for E4M3 and the linear map, down for the
int4 map). Inputs are cleaned first, so no NaN or Inf ever comes out: NaN encodes as 0, +-Inf and
magnitudes above ``CLAMP`` (FLT_MAX less 2 ulp) as +-CLAMP, and v's negative values and -0.0 as 0.
A power-of-two pre-scale keeps ``1 / absmax`` finite for subnormal blocks. The second moment's
scale never drops below ``V_FLOOR / 2^bits``, so once written v never decodes to 0 (an all-zero
block decodes to ``2^-100 / 2^bits``: its square root, ~1e-15, is far below any Adam eps); a
zero-filled state (all codes and scales 0) decodes to exactly 0, the fresh-optimizer state.

Error bounds per element x of a block whose cleaned absmax is A (checked by tests/test_codecs.py;
``error_bound`` computes them), with ``tiny = 2^-148`` covering subnormal decode rounding:

* m, 8 bits: ``|dec - x| <= 2^-4 * |x| * (1 + 2^-12) + 2^-18 / 1.875 * A + tiny`` (3 significant
  bits relative, absolute ``2.0e-6 * A`` below the smallest normal); in particular ``<= A / 30``.
* m, 4 bits: ``|dec - x| <= 0.1125 * A * (1 + 2^-12) + tiny`` (half the largest gap of the map);
  the element of largest magnitude decodes exactly (to within one rounding).
* v, 8 / 4 bits: with ``s = max(A, 2^-100) / 2^bits``: ``|dec - x| <= s / 2 * (1 + 2^-12)`` for
  ``x >= s / 2`` and ``dec = s`` (so ``|dec - x| <= s``) below; always ``dec >= s > 0``.

The fused optimizer step (``quantized.py``) uses exactly these codecs; its C++ kernel and torch
fallback agree with this module bit for bit.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from megatrain_lightning.store.layout import ALIGN

Kind = Literal["m", "v"]

M_BLOCK = {8: 256, 4: 128}  # elements per first-moment scale
V_BLOCK = 128  # elements per second-moment scale (both widths)

M8_TOP = 1.875  # largest E4M3 magnitude
M8_MIN_NORMAL = 2.0**-14
V_FLOOR = 2.0**-100
CLAMP = float(torch.tensor(0x7F7FFFFD, dtype=torch.int32).view(torch.float32))
_TINY = 2.0**-148
_PRE_LO, _PRE_HI = 2.0**-64, 2.0**64

# int4 first-moment map, sorted; the code of sorted index i is (i + 9) & 15 (so code 0 is 0.0)
M4_SORTED = torch.tensor(
    [-0.8875, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055, 0.0,
     0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0],
    dtype=torch.float32,
)  # fmt: skip
M4_MIDPOINTS = (M4_SORTED[:-1] + M4_SORTED[1:]) * 0.5  # float32 arithmetic, as the C++ kernel
M4_TABLE = M4_SORTED[(torch.arange(16) + 7) % 16]  # by code
M4_MAX_HALF_GAP = float(((M4_SORTED[1:] - M4_SORTED[:-1]) / 2).max())  # 0.1125


def _e4m3_table() -> Tensor:
    values = []
    for code in range(256):
        mag = code & 127
        exponent, mantissa = mag >> 3, mag & 7
        value = mag * 2.0**-17 if exponent == 0 else 2.0 ** (exponent - 15) * (1 + mantissa / 8)
        values.append(-value if code & 128 else value)  # code 128 is -0.0 (never produced)
    return torch.tensor(values, dtype=torch.float32)


M8_TABLE = _e4m3_table()  # by code, exact


def _check(kind: str, bits: int) -> None:
    if kind not in ("m", "v"):
        raise ValueError(f"kind must be 'm' or 'v', got {kind!r}")
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")


def block_size(kind: Kind, bits: int) -> int:
    """Elements per scale."""
    _check(kind, bits)
    return M_BLOCK[bits] if kind == "m" else V_BLOCK


def code_bytes(numel: int, bits: int) -> int:
    """Bytes of codes for ``numel`` elements (one moment)."""
    _check("m", bits)
    return numel if bits == 8 else (numel + 1) // 2


def num_scales(numel: int, kind: Kind, bits: int) -> int:
    """fp32 scales for ``numel`` elements (one moment)."""
    return -(-numel // block_size(kind, bits))


def state_bytes(numel: int, bits: int) -> int:
    """Bytes of m and v with their scales for ``numel`` elements: about 2.05 (int8) and 1.06 (int4)
    bytes per element, against 8 for fp32 moments."""
    return 2 * code_bytes(numel, bits) + 4 * (num_scales(numel, "m", bits) + num_scales(numel, "v", bits))


def state_slices(a: int, b: int, bits: int) -> tuple[slice, slice, slice]:
    """``(codes, m_scales, v_scales)`` index ranges of elements ``[a, b)`` of a flat buffer, for slicing
    the codes (either moment) and scales of the whole buffer; ``a`` must be a multiple of ``ALIGN``."""
    _check("m", bits)
    if a % ALIGN or not 0 <= a <= b:
        raise ValueError(f"a slice must start at a multiple of {ALIGN} and not end before it; got [{a}, {b})")
    codes = slice(a, b) if bits == 8 else slice(a // 2, (b + 1) // 2)
    mb = M_BLOCK[bits]
    return codes, slice(a // mb, -(-b // mb)), slice(a // V_BLOCK, -(-b // V_BLOCK))


def empty_state(
    numel: int, bits: int, device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Zeroed ``(m_codes, m_scales, v_codes, v_scales)``: decodes to m = v = 0 (a fresh optimizer)."""
    cb = code_bytes(numel, bits)
    return (
        torch.zeros(cb, dtype=torch.uint8, device=device),
        torch.zeros(num_scales(numel, "m", bits), dtype=torch.float32, device=device),
        torch.zeros(cb, dtype=torch.uint8, device=device),
        torch.zeros(num_scales(numel, "v", bits), dtype=torch.float32, device=device),
    )


# -- packing --


def pack4(codes: Tensor) -> Tensor:
    """uint8 codes < 16 -> two per byte (element 2j low nibble, 2j+1 high); odd length: high nibble 0."""
    codes = codes.reshape(-1)
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack4(packed: Tensor, numel: int) -> Tensor:
    """Inverse of :func:`pack4`: ``numel`` uint8 codes."""
    out = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)
    return out[:numel]


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


def encode_m_blocks(x: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """fp32 ``[blocks, B]`` -> (uint8 codes ``[blocks, B]`` unpacked, fp32 scales ``[blocks]``).
    Cleans the input (``clean_m``) first when it holds NaN, Inf or magnitudes above ``CLAMP``."""
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
        normal = (zb >> 20) & 1
        normal += zb
        normal += 0x7FFFF - (896 << 20)
        normal >>= 20
        sub = (z + 64.0).view(torch.int32)
        sub -= 0x42800000  # bits of 64.0: round(z * 2^17), half to even
        code = torch.where(z < M8_MIN_NORMAL, sub, normal).clamp_(max=127)
        code = torch.where(torch.signbit(x) & (code != 0), code | 128, code)
        return code.to(torch.uint8), scales
    positive = x.clamp(min=0).amax(dim=1)
    signed = torch.where(positive >= absmax, absmax, -absmax)
    inv = torch.where(zero, torch.zeros_like(absmax), _f32(1.0, x) / (signed * pre))
    y = (x * pre[:, None]).mul_(inv[:, None])
    index = torch.full(y.shape, 9, dtype=torch.uint8)  # (number of midpoints below y) + 9
    above = torch.empty(y.shape, dtype=torch.bool)
    for t in M4_MIDPOINTS.tolist():
        index += torch.gt(y, t, out=above)
    return index.bitwise_and_(15), signed


def decode_m_blocks(codes: Tensor, scales: Tensor, bits: int) -> Tensor:
    """uint8 codes ``[blocks, B]`` (unpacked) and scales ``[blocks]`` -> fp32 ``[blocks, B]``."""
    table = (M8_TABLE if bits == 8 else M4_TABLE).to(codes.device)
    return table[codes.long()] * scales[:, None]


def encode_v_blocks(x: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """fp32 ``[blocks, 128]`` -> (uint8 codes unpacked, fp32 scales ``[blocks]``). Cleans the input
    (``clean_v``) first when it holds NaN, Inf, negative values or magnitudes above ``CLAMP``."""
    levels = 1 << bits
    absmax = x.amax(dim=1)
    if _needs_cleaning(absmax) or not bool(x.amin() >= 0):
        x = clean_v(x)
        absmax = x.amax(dim=1)
    absmax = absmax.clamp_(min=V_FLOOR)
    inv = _f32(float(levels), x) / absmax
    scales = absmax * (1.0 / levels)
    code = torch.round(x * inv[:, None]).to(torch.int32)
    code -= 1
    return code.clamp_(0, levels - 1).to(torch.uint8), scales


def decode_v_blocks(codes: Tensor, scales: Tensor, bits: int) -> Tensor:
    return (codes.to(torch.int32) + 1).to(torch.float32) * scales[:, None]


# -- public codec --


def _blocks(x: Tensor, size: int) -> Tensor:
    pad = -x.numel() % size
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, size)


def quantize(x: Tensor, kind: Kind, bits: int) -> tuple[Tensor, Tensor]:
    """Any-shaped float tensor -> ``(codes uint8 [code_bytes(numel)], scales fp32 [num_scales])``."""
    _check(kind, bits)
    flat = x.detach().reshape(-1).to(torch.float32)
    numel = flat.numel()
    size = block_size(kind, bits)
    encode = encode_m_blocks if kind == "m" else encode_v_blocks
    codes, scales = encode(_blocks(flat, size), bits)
    codes = codes.reshape(-1)[:numel]
    return (codes if bits == 8 else pack4(codes)), scales


def dequantize(codes: Tensor, scales: Tensor, kind: Kind, bits: int, numel: int) -> Tensor:
    """Inverse of :func:`quantize`: fp32 ``[numel]``."""
    _check(kind, bits)
    size = block_size(kind, bits)
    if codes.numel() != code_bytes(numel, bits) or scales.numel() != num_scales(numel, kind, bits):
        raise ValueError(
            f"{numel} elements need {code_bytes(numel, bits)} code bytes and {num_scales(numel, kind, bits)} "
            f"scales; got {codes.numel()} and {scales.numel()}"
        )
    flat = codes.reshape(-1) if bits == 8 else unpack4(codes.reshape(-1), numel)
    blocks = _blocks(flat, size)
    decode = decode_m_blocks if kind == "m" else decode_v_blocks
    return decode(blocks, scales.reshape(-1).to(torch.float32), bits).reshape(-1)[:numel]


def error_bound(x: Tensor, kind: Kind, bits: int) -> Tensor:
    """The per-element bound on ``|dequantize(quantize(x)) - clean(x)|`` stated in the module docstring."""
    _check(kind, bits)
    flat = x.detach().reshape(-1).to(torch.float32)
    numel = flat.numel()
    size = block_size(kind, bits)
    clean = clean_m(flat) if kind == "m" else clean_v(flat)
    blocks = _blocks(clean, size).double()
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    slack = 1 + 2.0**-12
    if kind == "m" and bits == 8:
        bound = 2.0**-4 * blocks.abs() * slack + 2.0**-18 / M8_TOP * absmax + _TINY
    elif kind == "m":
        bound = (M4_MAX_HALF_GAP * slack) * absmax + _TINY + blocks * 0
    else:
        s = absmax.clamp(min=V_FLOOR) / (1 << bits)
        bound = torch.where(blocks >= s / 2, s / 2 * slack, s)
    return bound.reshape(-1)[:numel]


def max_relative_error(kind: Kind, bits: int) -> float:
    """The worst error as a fraction of the block absmax (the constant in the bounds above)."""
    _check(kind, bits)
    if kind == "m":
        return 1 / 30 if bits == 8 else M4_MAX_HALF_GAP
    return 1.0 / (1 << bits)


__all__ = [
    "ALIGN",
    "CLAMP",
    "M4_TABLE",
    "M8_TABLE",
    "M_BLOCK",
    "V_BLOCK",
    "V_FLOOR",
    "block_size",
    "code_bytes",
    "dequantize",
    "empty_state",
    "error_bound",
    "max_relative_error",
    "num_scales",
    "pack4",
    "quantize",
    "state_bytes",
    "state_slices",
    "unpack4",
]
