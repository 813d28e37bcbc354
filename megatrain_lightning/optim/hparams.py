"""What a block update knows of its param group and of clipping: frozen when ``step`` begins, so that
updates still running in worker threads never see a scheduler's later change."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass(frozen=True)
class GroupHparams:
    # A tensor ``lr`` or beta stays one (a copy): torch's AdamW then computes its step size and bias
    # corrections in fp32, and the fp32 moments' update, torch's own, does the same.
    lr: float | Tensor
    beta1: float | Tensor
    beta2: float | Tensor
    eps: float
    weight_decay: float
    maximize: bool
    foreach: bool | None  # the implementation the user chose: results match it bitwise
    fused: bool | None

    @classmethod
    def of(cls, group: dict[str, Any]) -> GroupHparams:
        beta1, beta2 = group["betas"]
        return cls(
            lr=_frozen(group["lr"]),
            beta1=_frozen(beta1),
            beta2=_frozen(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            maximize=bool(group.get("maximize", False)),
            foreach=group.get("foreach"),
            fused=group.get("fused"),
        )


def _frozen(value: float | Tensor) -> float | Tensor:
    """The value now: a scheduler may change a tensor ``lr`` in place while updates still run."""
    return value.detach().clone() if isinstance(value, Tensor) else float(value)


@dataclass(frozen=True)
class Clip:
    value: float | None = None  # clamp each gradient to [-value, value]
    coef: Tensor | None = None  # multiply each gradient (global-norm clipping)
