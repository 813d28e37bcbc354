"""The compute-dtype shadow's rounding: fp32 weights to bf16, as the slot copy rounds them.

Under bf16 compute the host tier keeps a bf16 copy (the *shadow*, :mod:`megatrain_lightning.store.host`)
of the weights that sit in the device slots in bf16, so that 2 bytes per parameter cross the link and
nothing is converted on the device. It must hold exactly what ``Tensor.to(torch.bfloat16)`` of the fp32
master gives (round to nearest even), or training would no longer be bitwise plain Lightning's. The
update writes it in the same pass over a chunk: the quantized kernel inside its loop, each 256 weights
while they are in L1 (``csrc/quantized_adamw.cpp``), and right after torch's own Adam on the chunk (fp32
moments: that arithmetic must stay torch's, bit for bit) :func:`to_bf16_` here, with the
compiled loop or, where the kernel is unavailable (or ``MEGATRAIN_QUANTIZED_BACKEND=torch``), torch's
conversion. Both write every NaN as the one quiet NaN ``0x7fc0`` (torch's vectorized conversion writes
``0xffff``, its scalar one ``0x7fc0``), so the two agree bit for bit on every input.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatrain_lightning.optim import kernel


def check(src: Tensor, dst: Tensor) -> None:
    """Raise unless ``src`` (fp32) and ``dst`` (bf16) are 1-D contiguous CPU tensors of one size."""
    for name, t, dtype in (("src", src, torch.float32), ("dst", dst, torch.bfloat16)):
        if t.dtype != dtype or t.device.type != "cpu" or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a 1-D contiguous CPU {dtype} tensor; got {t.dtype} {tuple(t.shape)}"
            )
    if src.numel() != dst.numel():
        raise ValueError(f"src has {src.numel()} elements and dst {dst.numel()}; they must match")


@torch.no_grad()
def to_bf16_(
    src: Tensor, dst: Tensor, num_threads: int | None = None, use_kernel: bool | None = None
) -> None:
    """``dst[:] = src`` rounded to bf16 (nearest even; NaN as ``0x7fc0``). ``num_threads`` defaults to
    ``torch.get_num_threads()``; ``use_kernel=False`` forces torch, ``True`` requires the compiled loop."""
    check(src, dst)
    if src.numel() == 0:
        return
    compiled = kernel.kernel_for(use_kernel)
    if compiled is None:
        torch_to_bf16_(src, dst)
        return
    threads = num_threads if num_threads is not None else torch.get_num_threads()
    if compiled.to_bf16(src.data_ptr(), dst.data_ptr(), src.numel(), max(1, int(threads))) != 0:
        raise RuntimeError("the bf16 rounding kernel failed")


def torch_to_bf16_(src: Tensor, dst: Tensor) -> None:
    """The fallback: torch's conversion (the slot copy's), NaNs made the kernel's one NaN."""
    dst.copy_(src)
    dst.masked_fill_(dst.isnan(), float("nan"))
