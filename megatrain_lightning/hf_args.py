"""Which ``TrainingArguments`` and Hugging Face ``Trainer`` arguments :class:`~.hf_trainer.Trainer` honours,
warns about (:class:`UnsupportedArgumentWarning`: training runs, without them) or refuses (they would train
other math than asked: another optimizer or loss)."""

from __future__ import annotations

import warnings
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException
from transformers import TrainingArguments

# TrainingArguments that cannot be honoured, with what to do instead; warned about when set.
_UNSUPPORTED = {
    "fp16": "megatrain computes in bf16 or fp32; use bf16=True",
    "bf16_full_eval": "evaluation uses the training precision",
    "fp16_full_eval": "evaluation uses the training precision",
    "tf32": "set torch.backends.cuda.matmul.allow_tf32 yourself",
    "deepspeed": "megatrain replaces DeepSpeed: it pages the model through one GPU itself",
    "fsdp": "megatrain trains on one device",
    "fsdp_config": "megatrain trains on one device",
    "parallelism_config": "megatrain trains on one device",
    "gradient_checkpointing_kwargs": "megatrain checkpoints each block itself (activation_checkpointing)",
    "activation_checkpointing_kwargs": "megatrain checkpoints each block itself (activation_checkpointing)",
    "torch_compile": "compiled models cannot be paged block by block",
    "use_liger_kernel": "not supported",
    "label_smoothing_factor": "the model's own loss is used",
    "neftune_noise_alpha": "not supported",
    "optim_args": "megatrain's CPU AdamW takes no extra arguments",
    "optim_target_modules": "megatrain trains every parameter",
    "auto_find_batch_size": "set per_device_train_batch_size (megatrain plan helps size it)",
    "torch_empty_cache_steps": "megatrain's device memory is a fixed pool of slots",
    "include_num_input_tokens_seen": "MegaTrainMonitor logs tokens_per_s instead",
    "logging_first_step": "not supported",
    "eval_on_start": "not supported",
    "load_best_model_at_end": "load a checkpoint from output_dir yourself",
    "push_to_hub": "not supported",
    "resume_from_checkpoint": "pass it to Trainer.train(resume_from_checkpoint=...)",
    "label_names": "batches must hold `labels` (or none: the inputs are the labels)",
    "eval_delay": "evaluation runs from the first interval",
    "metric_for_best_model": "checkpoints are kept newest first (save_total_limit)",
    "greater_is_better": "checkpoints are kept newest first (save_total_limit)",
    "save_only_model": "checkpoints hold the optimizer state, to resume from",
}

# Hugging Face Trainer arguments, and methods a subclass may override, that would train other math than
# asked if ignored (another optimizer, another loss): refused, with what to do instead.
_REFUSED_ARGUMENTS = {
    "optimizers": "megatrain builds its AdamW and scheduler from TrainingArguments (learning_rate, "
    "weight_decay, adam_beta1/2, adam_epsilon, lr_scheduler_type, warmup_steps): set those",
    "compute_loss_func": "megatrain trains the model's own loss",
    "model_init": "pass the model itself as `model`",
}
_OVERRIDABLE = (
    "compute_loss",
    "training_step",
    "create_optimizer",
    "create_scheduler",
    "get_train_dataloader",
)


# TrainingArguments.optim values that run AdamW's math (fp32 state, or the low-bit state megatrain's
# `optimizer_compression` gives); any other optimizer is refused, as `configure_optimizers` returning one is.
_ADAMW = (
    "adamw_torch",
    "adamw_torch_fused",
    "adamw_torch_xla",
    "adamw_torch_npu_fused",
    "adamw_apex_fused",  # transformers < 5
    "adamw_anyprecision",
    "paged_adamw_32bit",
)
_LOW_BIT_ADAMW = {
    "adamw_torch_8bit": "int8",
    "adamw_bnb_8bit": "int8",
    "adamw_8bit": "int8",
    "paged_adamw_8bit": "int8",
    "adamw_torch_4bit": "int4",
}


class UnsupportedArgumentWarning(UserWarning):
    """A ``TrainingArguments`` field or ``Trainer`` argument that megatrain ignores."""


def _ignored(message: str) -> None:
    """Warn of an argument mt.Trainer ignores; the warning points at the user's ``mt.Trainer(...)``."""
    warnings.warn(f"mt.Trainer ignores {message}", UnsupportedArgumentWarning, stacklevel=4)


def is_set(value: Any) -> bool:
    return bool(value) and value not in ("no", "none")


def strategy(value: Any) -> str:
    """The string of an ``IntervalStrategy``/``SaveStrategy`` member or of a plain string."""
    return str(getattr(value, "value", value))


def _check_optimizer(optim: str, strategy_options: dict[str, Any]) -> None:
    """AdamW runs as asked; AdamW with low-bit state asked here says where megatrain's is set; another
    optimizer would train other math: refused."""
    compression = _LOW_BIT_ADAMW.get(optim)
    if compression is not None and strategy_options.get("optimizer_compression", "none") in ("none", False):
        warnings.warn(
            f"TrainingArguments.optim={optim!r} asks for AdamW with {compression} state; megatrain's "
            f"optimizer state is set by `mt.init(optimizer_compression={compression!r})`, and is fp32 now.",
            UnsupportedArgumentWarning,
            stacklevel=4,
        )
    elif compression is None and optim not in _ADAMW:
        raise MisconfigurationException(
            f"mt.Trainer: TrainingArguments.optim={optim!r} is not AdamW; megatrain runs AdamW on the CPU "
            "(its update overlaps the backward). Use optim='adamw_torch' (the default), or train with "
            "Hugging Face's Trainer."
        )


def check_arguments(args: TrainingArguments, strategy_options: dict[str, Any]) -> None:
    """Warn about each argument ignored; refuse those that would train other math."""
    for name, instead in _UNSUPPORTED.items():
        value = getattr(args, name, None)
        if is_set(value):
            _ignored(f"TrainingArguments.{name}={value!r}: {instead}.")
    _check_optimizer(strategy(args.optim), strategy_options)
    reporters = [r for r in (args.report_to or []) if r not in ("none", "all")]
    if reporters:
        _ignored(
            f"TrainingArguments.report_to={reporters}: metrics go to a CSV logger under "
            f"{args.output_dir}/logs."
        )
    if strategy(args.logging_strategy) == "epoch":
        _ignored("TrainingArguments.logging_strategy='epoch': it logs every logging_steps steps.")
    sampling = strategy(getattr(args, "train_sampling_strategy", "random"))
    if sampling not in ("random", "sequential"):
        _ignored(
            f"TrainingArguments.train_sampling_strategy={sampling!r}: batches are drawn at random "
            "('random') or in order ('sequential')."
        )
    if strategy(args.lr_scheduler_type) == "reduce_lr_on_plateau":
        raise MisconfigurationException(
            "mt.Trainer: lr_scheduler_type='reduce_lr_on_plateau' needs an evaluation metric each step, "
            "which mt.Trainer does not feed it; use a schedule of steps ('linear', 'cosine', ...), or a "
            "LightningModule whose `configure_optimizers` monitors `val_loss`, with "
            "`Trainer(strategy='megatrain')`."
        )


def check_causal_lm(model: Any) -> None:
    """mt.Trainer trains a causal LM's next-token loss (its batches are token windows, its perplexity shifts
    the labels): another kind of model is refused, with the way to train it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if not any(cls.__name__ in causal for cls in type(model).__mro__):
        raise MisconfigurationException(
            f"mt.Trainer trains causal language models (`AutoModelForCausalLM`); {type(model).__name__} is "
            "another kind. Train it with `lightning.Trainer(strategy='megatrain')` and a LightningModule "
            "calling the model on your batches: it trains as under the default strategy."
        )


def check_trainer(trainer: type, kwargs: dict[str, Any], eval_dataset: Any, args: TrainingArguments) -> None:
    """Refuse Hugging Face ``Trainer`` arguments and overrides that would change the math if ignored, and
    evaluation it cannot run; warn about the other arguments, which it ignores."""
    for name, value in kwargs.items():
        if name in _REFUSED_ARGUMENTS and value is not None and value != (None, None):
            raise MisconfigurationException(f"mt.Trainer does not take `{name}`: {_REFUSED_ARGUMENTS[name]}.")
        _ignored(f"`{name}`")
    overridden = [name for name in _OVERRIDABLE for cls in trainer.__mro__[:-2] if name in vars(cls)]
    if overridden:
        raise MisconfigurationException(
            f"mt.Trainer does not call `{overridden[0]}`, which {trainer.__name__} overrides: it trains "
            "the model's own loss with AdamW. Write a LightningModule (your loss in `training_step`) and "
            "train it with `lightning.Trainer(strategy='megatrain')`."
        )
    if isinstance(eval_dataset, dict):
        raise MisconfigurationException(
            "mt.Trainer takes one eval_dataset, not a dict of them; evaluate each by "
            "`trainer.evaluate(dataset)`."
        )
    if eval_dataset is None and strategy(args.eval_strategy) != "no":
        raise ValueError(
            f"mt.Trainer: eval_strategy={strategy(args.eval_strategy)!r} needs an eval_dataset; pass one or "
            "set eval_strategy='no'."
        )
