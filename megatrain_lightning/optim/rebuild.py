"""The user's ``torch.optim.AdamW``/``Adam`` rebuilt as megatrain's CPU optimizer, and its schedulers
pointed at the rebuilt one."""

from __future__ import annotations

import functools
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch.optim import Optimizer

from megatrain_lightning.optim.adamw import CPUAdamW

_SUPPORTED = (torch.optim.AdamW, torch.optim.Adam)
_UNSUPPORTED_FLAGS = {
    "amsgrad": "not implemented",
    "capturable": "the update runs on the CPU, outside CUDA graphs",
    "differentiable": "the update runs outside autograd, on the store's buffers",
}


# The user's AdamW defaults CPUAdamW takes: a group added later (`BaseFinetuning`) gets them, as in torch.
_DEFAULTS = ("lr", "betas", "eps", "weight_decay", "maximize", "foreach", "fused")


def cpu_adamw_from(optimizer: Optimizer, cls: type[CPUAdamW] = CPUAdamW, **kwargs: Any) -> CPUAdamW:
    """Rebuild a ``torch.optim.AdamW``/``Adam`` (any param groups) as a ``CPUAdamW`` (or subclass ``cls``).

    The new optimizer shares ``optimizer``'s param-group dicts (so whatever changes their ``lr`` or
    ``betas`` changes this one's) and its class name (``LearningRateMonitor`` logs ``lr-AdamW``);
    its state starts empty, like a new torch optimizer's. Rebind schedulers with
    :func:`rebind_scheduler`.
    """
    if type(optimizer) not in _SUPPORTED:
        raise MisconfigurationException(
            "megatrain runs the optimizer on the CPU and supports `torch.optim.AdamW` and "
            f"`torch.optim.Adam`; `configure_optimizers` returned {type(optimizer).__name__}. "
            "Return one of those instead."
        )
    for flag, why in _UNSUPPORTED_FLAGS.items():
        if any(group.get(flag) for group in optimizer.param_groups):
            raise MisconfigurationException(
                f"megatrain's CPU AdamW does not support `{flag}=True` ({why}); set it to False."
            )
    decoupled = type(optimizer) is torch.optim.AdamW or bool(optimizer.defaults.get("decoupled_weight_decay"))
    defaults = {name: optimizer.defaults[name] for name in _DEFAULTS if name in optimizer.defaults}
    return _named_like(cls, type(optimizer).__name__)(
        optimizer.param_groups, decoupled_weight_decay=decoupled, **defaults, **kwargs
    )


@functools.cache
def _named_like(cls: type[CPUAdamW], name: str) -> type[CPUAdamW]:
    """``cls`` under the name of the user's optimizer class, which Lightning shows to users (the
    ``LearningRateMonitor`` keys ``lr-AdamW/pg1``, the optimizer's ``repr``)."""
    return type(name, (cls,), {"__module__": cls.__module__, "__qualname__": name})


def rebind_scheduler(scheduler: Any, optimizer: Optimizer) -> None:
    """Point ``scheduler`` and the schedulers it drives (``SequentialLR``, ``ChainedScheduler``) at
    ``optimizer``, the one Lightning steps (their step-order checks read it)."""
    scheduler.optimizer = optimizer
    for inner in getattr(scheduler, "_schedulers", ()):
        rebind_scheduler(inner, optimizer)
