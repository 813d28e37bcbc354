"""What megatrain reads from the user's Trainer and LightningModule before it trains: callbacks it cannot
serve, whether user code looks at the summed gradients before the optimizer step, and Hugging Face's own
activation checkpointing, which megatrain's block recompute takes over."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden

_GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")  # where users read gradients


def reads_final_gradients(trainer: pl.Trainer) -> bool:
    """Whether user code may see or change the summed gradients before the optimizer step (clipping,
    gradient norms in ``on_before_optimizer_step``): then no block is updated before the backward ends."""
    module = trainer.lightning_module
    return (
        # Manual optimization may clip (`self.clip_gradients`) after a backward inside `opt.step(closure)`.
        not module.automatic_optimization
        or is_overridden("configure_gradient_clipping", module, pl.LightningModule)
        or any(is_overridden(hook, module, pl.LightningModule) for hook in _GRADIENT_HOOKS)
        or any(is_overridden(hook, c, pl.Callback) for hook in _GRADIENT_HOOKS for c in trainer.callbacks)
    )


def refuse_weight_averaging(trainer: pl.Trainer) -> None:
    """Weight-averaging callbacks keep their own copy of the parameters: megatrain holds them in its store."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging

    for callback in trainer.callbacks:
        if isinstance(callback, (StochasticWeightAveraging, WeightAveraging)):
            raise MisconfigurationException(
                f"megatrain does not support `{type(callback).__name__}` yet: it keeps an averaged "
                "copy of the model's parameters, while megatrain keeps the weights in its store and "
                "holds placeholders in the module. Remove the callback, or train with "
                "the default strategy."
            )


def _call_through(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Hugging Face's checkpoint function while megatrain trains: the layer runs as it is."""
    return function(*args, **kwargs)


def take_over_hf_checkpointing(trainer: pl.Trainer, recomputes: bool) -> Callable[[], None]:
    """Let megatrain's recompute stand in for Hugging Face's activation checkpointing
    (``gradient_checkpointing_enable()``); returns what puts the user's checkpoint functions back.

    Both recompute a layer in backward, and one inside the other runs it three times, or fails: the
    reentrant variant cannot serve ``torch.autograd.grad``, and without megatrain's recompute the
    block's backward has no gradients to give Hugging Face's. So Hugging Face's checkpoint function
    calls straight through; what else its checkpointing does in training (no key/value cache) is
    what megatrain's recompute does too, so the losses and weights stay bitwise those of the default
    strategy.
    """
    layers = [
        m
        for m in trainer.lightning_module.modules()
        if getattr(m, "gradient_checkpointing", False) is True and hasattr(m, "_gradient_checkpointing_func")
    ]
    if layers and not recomputes and trainer.state.fn == TrainerFn.FITTING:
        raise MisconfigurationException(
            "The model has Hugging Face's activation checkpointing on (`gradient_checkpointing_enable()`), "
            "and `MegaTrainStrategy(activation_checkpointing=False)` keeps every block's activations "
            "instead. megatrain recomputes whole blocks itself: leave `activation_checkpointing` on (the "
            "default), which recomputes each block as Hugging Face's checkpointing does, or call "
            "`model.gradient_checkpointing_disable()`."
        )
    originals = [(m, m._gradient_checkpointing_func) for m in layers]
    for m in layers:
        m._gradient_checkpointing_func = _call_through

    def restore() -> None:
        for m, function in originals:
            m._gradient_checkpointing_func = function

    return restore
