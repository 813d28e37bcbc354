"""Fused AdamW step over block-quantized moments, int8 / int4 / int3 / int2 (formats: ``codecs.py``).

:func:`quantized_adamw_` updates one slice ``[a, b)`` of a block's flat fp32 buffers in place:
per chunk of 256 elements it decodes m and v, runs the fp32 AdamW update and re-encodes them, so
every byte of parameter, gradient and state is read once and written once (about 16.1 bytes per
parameter for int8, 14.2 for int4, 13.8 for int3, 13.4 for int2, against 28 for fp32 moments).

Two implementations, bit-identical in their results:

* a small C++ kernel (``csrc/quantized_adamw.cpp``; AVX-512 or AVX2 where the CPU has them,
  portable C++ otherwise; OpenMP across chunks), built and loaded by :mod:`.kernel` (the GIL is
  released during a step);
* a chunked pure-torch fallback, used (with one warning) when no compiler is found or the build
  fails, or always with ``MEGATRAIN_QUANTIZED_BACKEND=torch``.
"""

from __future__ import annotations

import ctypes
import math
import struct
from dataclasses import dataclass

import torch
from torch import Tensor

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy comes with transformers
    np = None

from megatrain_lightning.optim import bf16, codecs, kernel, packing, rounding
from megatrain_lightning.optim.codecs import ALIGN, FORMATS

_FALLBACK_CHUNK = 1 << 20  # elements per step of the torch fallback (a multiple of ALIGN)


# -- hyperparameters, rounded once to the float32 values both implementations use --


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True)
class _Hyper:
    decay: float  # 1 - lr * wd (decoupled), else 1
    wd: float  # L2 coefficient (coupled), else 0
    b1: float
    omb1: float
    b2: float
    omb2: float
    ibc2: float  # 1 / sqrt(1 - beta2^step)
    eps: float
    nstep: float  # -lr / (1 - beta1^step)
    l2: bool
    maximize: bool

    def floats(self) -> list[float]:
        return [self.decay, self.wd, self.b1, self.omb1, self.b2, self.omb2, self.ibc2, self.eps, self.nstep]


def _hyper(
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
) -> _Hyper:
    if step < 1:
        raise ValueError(f"step is the step number after incrementing (1 on the first update); got {step}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"betas must be in [0, 1); got ({beta1}, {beta2})")
    bc1 = 1 - beta1**step
    bc2 = 1 - beta2**step
    l2 = not decoupled_weight_decay and weight_decay != 0
    return _Hyper(
        decay=_f32(1 - lr * weight_decay) if decoupled_weight_decay and weight_decay != 0 else 1.0,
        wd=_f32(weight_decay) if l2 else 0.0,
        b1=_f32(beta1),
        omb1=_f32(1 - beta1),
        b2=_f32(beta2),
        omb2=_f32(1 - beta2),
        ibc2=_f32(1 / math.sqrt(bc2)),
        eps=_f32(eps),
        nstep=_f32(-lr / bc1),
        l2=l2,
        maximize=bool(maximize),
    )


@dataclass(frozen=True)
class _Rounding:
    """Which moments are rounded stochastically, their keys, and the stream index of the slice's start."""

    m: bool
    v: bool
    key_m: int
    key_v: int
    offset: int


def _rounding(bits: int, stochastic: tuple[str, ...], seed: int, step: int, offset: int) -> _Rounding:
    if not set(stochastic) <= {"m", "v"}:
        raise ValueError(f"stochastic must name moments 'm' and/or 'v'; got {stochastic!r} with bits={bits}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0; got {offset}")
    key_m, key_v = rounding.rounding_keys(seed, step) if stochastic else (0, 0)
    return _Rounding("m" in stochastic, "v" in stochastic, key_m, key_v, offset)


# -- the step --


def _validate(
    param: Tensor,
    grad: Tensor,
    m_codes: Tensor,
    m_scales: Tensor,
    v_codes: Tensor,
    v_scales: Tensor,
    bits: int,
) -> None:
    if bits not in FORMATS:
        raise ValueError(f"bits must be one of {tuple(FORMATS)}, got {bits!r}")
    n = param.numel()
    expect = {
        "param": (param, torch.float32, n),
        "grad": (grad, torch.float32, n),
        "m_codes": (m_codes, torch.uint8, codecs.code_bytes(n, "m", bits)),
        "v_codes": (v_codes, torch.uint8, codecs.code_bytes(n, "v", bits)),
        "m_scales": (m_scales, torch.float32, codecs.num_scales(n, "m", bits)),
        "v_scales": (v_scales, torch.float32, codecs.num_scales(n, "v", bits)),
    }
    for name, (t, dtype, numel) in expect.items():
        if t.dtype != dtype or t.device.type != "cpu" or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a 1-D contiguous CPU {dtype} tensor; got {t.dtype} {tuple(t.shape)}"
            )
        if t.numel() != numel:
            raise ValueError(f"{name} has {t.numel()} elements; {n} parameters with bits={bits} need {numel}")


@torch.no_grad()
def quantized_adamw_(
    param: Tensor,
    grad: Tensor,
    m_codes: Tensor,
    m_scales: Tensor,
    v_codes: Tensor,
    v_scales: Tensor,
    *,
    bits: int,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool = True,
    maximize: bool = False,
    stochastic: tuple[str, ...] | None = None,
    seed: int = 0,
    offset: int = 0,
    shadow: Tensor | None = None,
    num_threads: int | None = None,
    use_kernel: bool | None = None,
) -> None:
    """One AdamW step on a slice of a block, updating ``param`` and the quantized moments in place.

    ``param``/``grad``: 1-D contiguous fp32 views of elements ``[a, b)`` of a block's flat buffers,
    with ``a`` a multiple of 256. ``m_codes``/``v_codes`` (uint8) and ``m_scales``/``v_scales``
    (fp32) are the matching slices of the state (``codecs.state_slices(a, b, bits)``; ``bits`` names
    the format, a key of ``codecs.FORMATS``). Only elements ``[a, b)`` change: when the slice ends
    inside a code byte, the bits of the elements after it are kept; the scale of a last partial
    block is computed from the slice's elements alone.

    Semantics of ``torch.optim.AdamW`` (``decoupled_weight_decay=True``) or ``Adam`` with L2 weight
    decay, ``step`` being the step count after incrementing (1 on the first update), except that m
    and v are decoded before and re-encoded after the update.

    ``stochastic`` names the moments re-encoded with stochastic rounding (``None``: the format's
    choice, ``FORMATS[bits].stochastic``): element ``offset + i`` of the stream
    ``seed`` (e.g. a block, whose flat buffer starts at offset 0) draws ``rounding.uniforms`` keyed by
    ``rounding.rounding_keys(seed, step)``, so the result does not depend on how a block is cut into
    slices or threads. ``shadow``: a bf16 tensor of ``param``'s size that receives the updated weights
    rounded as ``Tensor.to(torch.bfloat16)`` rounds them (:mod:`.bf16`), in the same pass.
    ``num_threads`` defaults to ``torch.get_num_threads()``; ``use_kernel=False`` forces the torch
    fallback, ``True`` requires the compiled kernel.
    """
    _validate(param, grad, m_codes, m_scales, v_codes, v_scales, bits)
    if shadow is not None:
        bf16.check(param, shadow)
    h = _hyper(step, lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize)
    sr = _rounding(bits, FORMATS[bits].stochastic if stochastic is None else stochastic, seed, step, offset)
    n = param.numel()
    if n == 0:
        return
    compiled = kernel.kernel_for(use_kernel)
    if compiled is None:
        _torch_step(param, grad, m_codes, m_scales, v_codes, v_scales, bits, h, sr)
        if shadow is not None:
            bf16.torch_to_bf16_(param, shadow)
        return
    threads = num_threads if num_threads is not None else torch.get_num_threads()
    hyper = (ctypes.c_float * 9)(*h.floats())
    rc = compiled.step(
        param.data_ptr(),
        grad.data_ptr(),
        m_codes.data_ptr(),
        m_scales.data_ptr(),
        v_codes.data_ptr(),
        v_scales.data_ptr(),
        shadow.data_ptr() if shadow is not None else None,
        n,
        bits,
        ctypes.addressof(hyper),
        int(h.maximize),
        int(h.l2),
        max(1, int(threads)),
        int(sr.m) | int(sr.v) << 1,
        sr.key_m,
        sr.key_v,
        sr.offset,
    )
    if rc != 0:
        raise RuntimeError(f"quantized AdamW kernel failed with code {rc}")


def _sqrt(x: Tensor) -> Tensor:
    """Correctly rounded fp32 square root, as the kernel's. ``torch.sqrt`` on fp32 CPU tensors is
    vectorized with an approximation that is off by one ulp for ~0.7% of inputs; numpy uses the
    IEEE instruction."""
    if np is not None:
        return torch.from_numpy(np.sqrt(x.numpy()))
    return torch.sqrt(x.double()).float()  # double rounding is innocuous for sqrt (53 >= 2*24 + 2)


def _torch_step(
    param: Tensor,
    grad: Tensor,
    m_codes: Tensor,
    m_scales: Tensor,
    v_codes: Tensor,
    v_scales: Tensor,
    bits: int,
    h: _Hyper,
    sr: _Rounding,
) -> None:
    n = param.numel()
    for a in range(0, n, _FALLBACK_CHUNK):
        b = min(n, a + _FALLBACK_CHUNK)
        mc, ms, vc, vs = codecs.state_slices(a, b, bits)
        _torch_chunk(
            param[a:b], grad[a:b], m_codes[mc], m_scales[ms], v_codes[vc], v_scales[vs], bits, h, sr, a
        )


def _torch_chunk(
    p: Tensor,
    g: Tensor,
    mc: Tensor,
    ms: Tensor,
    vc: Tensor,
    vs: Tensor,
    bits: int,
    h: _Hyper,
    sr: _Rounding,
    start: int,
) -> None:
    """The kernel's arithmetic, operation for operation, on a slice starting at a multiple of 256.
    Works on zero-padded copies of whole 256-element chunks; padding lanes get m = v = 0 before the
    block maxima, as in the kernel."""
    fmt = FORMATS[bits]
    n = p.numel()
    padded = -(-n // ALIGN) * ALIGN
    m = codecs.decode_m_blocks(
        _unpacked(mc, padded, fmt.m_bits).view(-1, fmt.m_block), _padded(ms, padded // fmt.m_block), bits
    ).view(-1)
    v = codecs.decode_v_blocks(
        _unpacked(vc, padded, fmt.v_bits).view(-1, fmt.v_block), _padded(vs, padded // fmt.v_block), bits
    ).view(-1)
    gi = _padded(g, padded)
    if h.maximize:
        gi.neg_()
    pi = _padded(p, padded)
    if h.l2:
        gi += pi * h.wd
    if h.decay != 1.0:
        pi *= h.decay
    m *= h.b1
    m += gi * h.omb1
    v *= h.b2
    gi *= gi
    gi *= h.omb2
    v += gi
    den = _sqrt(v)
    den *= h.ibc2
    den += h.eps
    den = torch.div(m, den, out=den)
    den *= h.nstep
    pi += den
    p.copy_(pi[:n])
    m[n:] = 0.0
    v[n:] = 0.0
    um = rounding.uniforms(sr.offset + start, padded, sr.key_m).view(-1, fmt.m_block) if sr.m else None
    uv = rounding.uniforms(sr.offset + start, padded, sr.key_v).view(-1, fmt.v_block) if sr.v else None
    new_m, m_scale = codecs.encode_m_blocks(m.view(-1, fmt.m_block), bits, um)
    new_v, v_scale = codecs.encode_v_blocks(v.view(-1, fmt.v_block), bits, uv)
    ms.copy_(m_scale[: ms.numel()])
    vs.copy_(v_scale[: vs.numel()])
    for codes, new, w in ((mc, new_m, fmt.m_bits), (vc, new_v, fmt.v_bits)):
        packed = packing.pack(new.view(-1)[:n], w)
        if n * w % 8:  # keep the bits of the elements after the slice in its last byte
            keep = (0xFF << (n * w % 8)) & 0xFF
            packed[-1] = (codes[-1] & keep) | packed[-1]
        codes.copy_(packed)


def _padded(x: Tensor, size: int) -> Tensor:
    """A copy of ``x`` zero-padded to ``size`` elements."""
    out = torch.zeros(size, dtype=x.dtype)
    out[: x.numel()] = x
    return out


def _unpacked(packed: Tensor, size: int, width: int) -> Tensor:
    """``size`` codes (zero beyond the packed ones) from ``packed``."""
    out = torch.zeros(size, dtype=torch.uint8)
    codes = packing.unpack(packed, packed.numel() * 8 // width, width)
    out[: codes.numel()] = codes
    return out


__all__ = ["ALIGN", "quantized_adamw_"]
