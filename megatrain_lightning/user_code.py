"""What megatrain reads from the user's Trainer and LightningModule before it trains: what it cannot serve
(a checkpoint to resume from that does not exist, weight-averaging callbacks, a checkpoint IO plugin,
compiled modules, router logits on an old transformers), weights it trains otherwise than cast, whether
user code looks at the summed gradients before the optimizer step, and Hugging Face's own activation
checkpointing, which megatrain's block recompute takes over."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from megatrain_lightning.engine.captures import routes_captures
from megatrain_lightning.engine.placeholders import ParamPlaceholder
from megatrain_lightning.engine.weights import GRADIENT_HOOK, has_gradient_hooks
from megatrain_lightning.serialization.checkpoint_dir import missing_resume_path, resume_path_of_this_run

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


def check_before_training(trainer: pl.Trainer) -> None:
    """Refuse, before anything is built, what megatrain cannot serve in the user's Trainer and module, and
    warn where it trains otherwise than asked."""
    if problem := missing_resume_path(resume_path_of_this_run()):
        raise FileNotFoundError(problem)
    _refuse_weight_callbacks(trainer)
    _refuse_checkpoint_io(trainer)
    _refuse_compiled_modules(trainer.lightning_module)
    _refuse_gradient_hooks(trainer.lightning_module)
    if trainer.state.fn == TrainerFn.FITTING and not routes_captures():
        _refuse_router_logits(trainer.lightning_module)
    if trainer.precision != "bf16-true":
        _warn_narrow_weights(trainer.lightning_module)


def _refuse_gradient_hooks(module: nn.Module) -> None:
    """A hook of the user's on a parameter (not yet a placeholder: the first fit) would be lost with it."""
    for name, param in module.named_parameters():
        if not isinstance(param, ParamPlaceholder) and has_gradient_hooks(param):
            raise MisconfigurationException(GRADIENT_HOOK.format(name=name))


def _refuse_weight_callbacks(trainer: pl.Trainer) -> None:
    """Callbacks that keep their own copy of the parameters (weight averaging) or replace them by a product
    of tensors (pruning): megatrain holds the weights in its store and placeholders in the module."""
    from lightning.pytorch.callbacks import ModelPruning, StochasticWeightAveraging, WeightAveraging

    for callback in trainer.callbacks:
        if isinstance(callback, (StochasticWeightAveraging, WeightAveraging)):
            raise MisconfigurationException(
                f"megatrain does not support `{type(callback).__name__}` yet: it keeps an averaged "
                "copy of the model's parameters, while megatrain keeps the weights in its store and "
                "holds placeholders in the module. Remove the callback (an EMA of your own, a callback "
                "that keeps a `copy.deepcopy` of the model and `lerp_`s its weights towards the module's, "
                "works), or train with the default strategy."
            )
        if isinstance(callback, ModelPruning):
            raise MisconfigurationException(
                "megatrain does not support `ModelPruning`: `torch.nn.utils.prune` replaces each pruned "
                "weight by `weight_orig * mask`, computed in a forward hook outside megatrain's store of "
                "the layer's weights. Remove the callback, or train with the default strategy."
            )


def _refuse_checkpoint_io(trainer: pl.Trainer) -> None:
    """megatrain writes and reads its checkpoint folders itself, each block streamed from or into its store:
    a ``CheckpointIO`` plugin of the user's would never be called for them (silently skipping what it
    does: another storage, an upload), and ``AsyncCheckpointIO``'s saves run synchronously."""
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    plugin = trainer.strategy.checkpoint_io
    inner = plugin.checkpoint_io if isinstance(plugin, AsyncCheckpointIO) else plugin
    if type(inner) is not TorchCheckpointIO:
        raise MisconfigurationException(
            f"megatrain writes and reads its checkpoints itself (a folder, each block streamed from its "
            f"store), so the `{type(inner).__name__}` plugin would never be called. Remove it from "
            "`Trainer(plugins=...)` and copy or upload the checkpoint folders once written, or train with "
            "the default strategy."
        )
    if plugin is not inner:
        rank_zero_warn(
            "megatrain writes its checkpoints itself, as the training runs: `AsyncCheckpointIO` is not used "
            "(each save takes the time the store's blocks take to write)."
        )


def _refuse_compiled_modules(module: nn.Module) -> None:
    """A compiled module traces through megatrain's paged calls, which swap weights in and out."""
    from torch._dynamo.eval_frame import OptimizedModule

    compiled = [name or "the module" for name, m in module.named_modules() if isinstance(m, OptimizedModule)]
    if compiled:
        raise MisconfigurationException(
            f"megatrain cannot page a `torch.compile`d module ({compiled[0]}): compiling traces through "
            "the block calls that swap its weights in and out of the device. Leave the model uncompiled, "
            "or train with the default strategy."
        )


def _refuse_router_logits(module: nn.Module) -> None:
    """Before transformers 5 a mixture-of-experts model collects its router logits from inside each layer
    where megatrain cannot reach them (:mod:`.engine.captures` routes them out of the layers from 5 on)."""
    for m in module.modules():
        if getattr(getattr(m, "config", None), "output_router_logits", False) is True:
            raise MisconfigurationException(
                "megatrain trains with `output_router_logits=True` (a mixture of experts' load-balancing "
                "loss) from transformers 5 on: before, the model collects each layer's router logits "
                "outside the layer's outputs, out of megatrain's reach, and their gradients would be "
                "lost. Upgrade transformers (`pip install 'transformers>=5'`), set "
                "`model.config.output_router_logits = False` (no load-balancing loss), or train with the "
                "default strategy."
            )


def _warn_narrow_weights(module: nn.Module) -> None:
    """megatrain's store holds fp32 masters: weights cast to bf16 by the user are trained in fp32."""
    narrow = sorted({str(p.dtype) for p in module.parameters() if p.is_floating_point()} - {"torch.float32"})
    if narrow:
        rank_zero_warn(
            f"megatrain keeps fp32 master weights: the model's {', '.join(narrow)} "
            "parameters are held and computed with in fp32 (their values exactly, widened), frozen ones too "
            "(a teacher cast to bf16 computes in fp32). For bf16 compute set the Trainer's `precision` "
            "('bf16-mixed' or 'bf16-true') instead of casting the model."
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
