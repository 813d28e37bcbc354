"""What megatrain reads from the user's Trainer and LightningModule before it trains: callbacks it cannot
serve, and whether user code looks at the summed gradients before the optimizer step."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.fabric.utilities.exceptions import MisconfigurationException
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
