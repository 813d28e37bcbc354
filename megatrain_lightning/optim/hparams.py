"""What a block update knows of its param group and of clipping: frozen when ``step`` begins, so that
updates still running in worker threads never see a scheduler's later change."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass(frozen=True)
class GroupHparams:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    maximize: bool
    foreach: bool | None  # the implementation the user chose: results match it bitwise
    fused: bool | None

    @classmethod
    def of(cls, group: dict[str, Any]) -> GroupHparams:
        beta1, beta2 = group["betas"]
        return cls(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            maximize=bool(group.get("maximize", False)),
            foreach=group.get("foreach"),
            fused=group.get("fused"),
        )


@dataclass(frozen=True)
class Clip:
    value: float | None = None  # clamp each gradient to [-value, value]
    coef: Tensor | None = None  # multiply each gradient (global-norm clipping)
