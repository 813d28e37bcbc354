"""Precision for megatrain: master weights always fp32 in the store; slots in the compute dtype (per
parameter: ``engine/slots.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any, Literal

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.types import Steppable
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from typing_extensions import override

_PRECISION = Literal["32-true", "bf16-mixed", "bf16-true"]
SUPPORTED: tuple[str, ...] = ("32-true", "bf16-mixed", "bf16-true")


class MegaTrainPrecision(Precision):
    """``"32-true"``: fp32 slots. ``"bf16-mixed"``: under autocast, with bf16 slots for the weights autocast
    casts and fp32 ones for embeddings and one-dimensional parameters (``engine/slots.py``), as Lightning's
    ``bf16-mixed`` computes. ``"bf16-true"``: bf16 slots, activations and buffers. Gradients are summed
    and the optimizer runs in fp32 on the host in every case.
    """

    def __init__(self, precision: _PRECISION = "32-true", device: str | None = None) -> None:
        if precision not in SUPPORTED:
            raise MisconfigurationException(
                f"megatrain supports precision {', '.join(repr(p) for p in SUPPORTED)}; got {precision!r}."
            )
        self.precision = precision
        self.device = device

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float32 if self.precision == "32-true" else torch.bfloat16

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        # Runs after the engine adopted the weights: only meta parameters and buffers change dtype.
        return module.to(torch.bfloat16) if self.precision == "bf16-true" else module

    @override
    def convert_input(self, data: Any) -> Any:
        if self.precision != "bf16-true":
            return data
        from lightning.fabric.utilities.apply_func import apply_to_collection

        return apply_to_collection(
            data, Tensor, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t
        )

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.precision == "bf16-mixed":
            with torch.autocast(self.device or "cpu", dtype=torch.bfloat16):
                yield
        elif self.precision == "bf16-true":
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                yield
            finally:
                torch.set_default_dtype(default)
        else:
            yield

    # Gradients live in the store: the optimizer clips them. ``LightningModule.clip_gradients`` (manual
    # optimization) passes the ``LightningOptimizer`` wrapper, a copy of the optimizer's ``__dict__``
    # on which the clip coefficient would be set and lost: clip on the optimizer it wraps.

    @override
    def clip_grad_by_value(self, optimizer: Steppable, clip_val: int | float) -> None:
        getattr(optimizer, "_optimizer", optimizer).clip_grad_value_(clip_val)

    @override
    def clip_grad_by_norm(self, optimizer: Steppable, clip_val: int | float) -> None:
        getattr(optimizer, "_optimizer", optimizer).clip_grad_norm_(clip_val)
