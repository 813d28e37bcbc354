"""The seed article's API for Hugging Face ``Trainer`` users::

    import megatrain_lightning as mt

    mt.init(offload_dir="/nvme/offload", max_vram_gb=20)
    mt.Trainer(model=hf_model, train_dataset=ds, args=TrainingArguments(...)).train()

``Trainer`` runs Lightning with the megatrain strategy and maps the ``TrainingArguments`` it can
honour onto Lightning (batch size, accumulation, AdamW hyperparameters, the ``transformers``
scheduler and warmup, clipping, steps or epochs, logging, saving and evaluation intervals,
``output_dir``, ``bf16``, seeds, data loading). Each argument it cannot honour is named in one
:class:`UnsupportedArgumentWarning`; one that would train other math if ignored is refused
(:mod:`.hf_args`). Datasets yield dicts with ``input_ids`` (and optionally
``attention_mask`` and ``labels``; without labels the inputs are the labels, padding masked).
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Sized
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset
from transformers import (
    PreTrainedModel,
    TrainerState,
    TrainingArguments,
    default_data_collator,
    get_scheduler,
)
from transformers.trainer_utils import TrainOutput
from typing_extensions import override

from megatrain_lightning.hf_args import (
    UnsupportedArgumentWarning,
    check_arguments,
    check_causal_lm,
    check_trainer,
    strategy,
)
from megatrain_lightning.models import CausalLMModule
from megatrain_lightning.strategy import MegaTrainStrategy
from megatrain_lightning.telemetry.monitor import MegaTrainMonitor, with_progress_bar

_STRATEGY_OPTIONS: dict[str, Any] = {}
_MODEL_INPUTS = ("input_ids", "attention_mask", "labels")


def init(
    offload_dir: str | None = None,
    max_vram_gb: float | None = None,
    max_cpu_gb: float | None = None,
    optimizer_compression: str | bool = "none",
    **strategy_kwargs: Any,
) -> None:
    """Set the :class:`MegaTrainStrategy` options of every later :class:`Trainer` (replacing earlier ones).

    The options are checked here, so a mistake surfaces at ``init`` rather than at ``train()``.
    ``strategy_kwargs`` are further ``MegaTrainStrategy`` arguments (e.g. ``prefetch_depth``).
    """
    options = dict(
        offload_dir=offload_dir,
        max_vram_gb=max_vram_gb,
        max_cpu_gb=max_cpu_gb,
        optimizer_compression=optimizer_compression,
        **strategy_kwargs,
    )
    MegaTrainStrategy(**options)
    _STRATEGY_OPTIONS.clear()
    _STRATEGY_OPTIONS.update(options)


def _interval(value: float, total_steps: int) -> int:
    """Hugging Face step intervals below 1 are fractions of the whole run."""
    return max(1, math.ceil(value * total_steps)) if value < 1 else int(value)


def _log_interval(logging_steps: float, total_steps: int) -> int:
    """``logging_steps``, but at least ten logs a run: HF's default 500 would log nothing in a short one."""
    return min(_interval(logging_steps, total_steps), max(1, total_steps // 10))


class _Collator:
    """The user's collator (or ``default_data_collator``), then labels from inputs when missing."""

    def __init__(self, collate: Callable[[list[Any]], dict[str, Any]] | None) -> None:
        self.collate = collate or default_data_collator

    def __call__(self, features: list[Any]) -> dict[str, torch.Tensor]:
        batch = self.collate(features)
        if "labels" not in batch:
            labels = batch["input_ids"].clone()
            if "attention_mask" in batch:
                labels[batch["attention_mask"] == 0] = -100
            batch["labels"] = labels
        return {k: batch[k] for k in _MODEL_INPUTS if k in batch}


class TrainingArgumentsModule(CausalLMModule):
    """``CausalLMModule`` with the ``transformers`` scheduler named by ``lr_scheduler_type``.

    Args:
        warmup: Warmup steps, or below 1 a fraction of the training steps (as ``warmup_steps``).
        lr_scheduler_type: Any name ``transformers.get_scheduler`` takes (``linear``, ``cosine``,
            ``constant``, ``constant_with_warmup``, ...).
        lr_scheduler_kwargs: Its extra arguments.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        warmup: float = 0,
        lr_scheduler_type: str = "linear",
        lr_scheduler_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(model, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, scheduler="constant")
        self.loss_sum = 0.0
        self.loss_count = 0

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.loss_sum += float(loss.detach())
        self.loss_count += 1
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.param_groups(), lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps)
        total = int(self.trainer.estimated_stepping_batches)
        warmup = _interval(hp.warmup, total) if hp.warmup else 0
        scheduler = get_scheduler(
            hp.lr_scheduler_type,
            optimizer,
            num_warmup_steps=warmup,
            num_training_steps=total,
            scheduler_specific_kwargs=hp.lr_scheduler_kwargs or {},
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Trainer:
    """Train a Hugging Face causal LM from ``TrainingArguments`` with Lightning and the megatrain strategy.

    Args:
        model: The model to train; afterwards its weights live in megatrain's store (its
            ``state_dict()`` and ``save_pretrained`` read them from there).
        args: Training arguments; default ``TrainingArguments("trainer_output")``.
        data_collator: Turns a list of dataset items into a batch; default ``default_data_collator``.
        train_dataset: Items are dicts with ``input_ids`` (and optionally ``attention_mask``, ``labels``).
        eval_dataset: Evaluated per ``eval_strategy`` and by :meth:`evaluate`.
        **kwargs: Other Hugging Face ``Trainer`` arguments are not supported and warned about.
    """

    def __init__(
        self,
        model: PreTrainedModel | None = None,
        args: TrainingArguments | None = None,
        data_collator: Callable[[list[Any]], dict[str, Any]] | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | None = None,
        **kwargs: Any,
    ) -> None:
        self.args = args if args is not None else TrainingArguments(output_dir="trainer_output")
        check_trainer(type(self), kwargs, eval_dataset, self.args)
        if model is None:
            raise MisconfigurationException("mt.Trainer needs the model to train: `mt.Trainer(model=...)`.")
        check_causal_lm(model)
        check_arguments(self.args, _STRATEGY_OPTIONS)
        self.model = model
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.collate = _Collator(data_collator)
        a = self.args
        self.module = TrainingArgumentsModule(
            model,
            lr=a.learning_rate,
            weight_decay=a.weight_decay,
            betas=(a.adam_beta1, a.adam_beta2),
            eps=a.adam_epsilon,
            warmup=a.warmup_steps or getattr(a, "warmup_ratio", 0),  # transformers < 5 has warmup_ratio
            lr_scheduler_type=str(getattr(a.lr_scheduler_type, "value", a.lr_scheduler_type)),
            lr_scheduler_kwargs=a.lr_scheduler_kwargs,
        )
        self.trainer: L.Trainer | None = None  # the Lightning Trainer of the last train() or evaluate()
        self.state = TrainerState()  # Hugging Face's: step, epoch and ``log_history`` of the last train()

    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Fit; ``resume_from_checkpoint=True`` resumes from ``<output_dir>/checkpoints/last.ckpt``."""
        if self.train_dataset is None:
            raise ValueError("mt.Trainer.train() needs a train_dataset")
        a = self.args
        L.seed_everything(a.seed, workers=True)
        train_loader = self._loader(self.train_dataset, a.per_device_train_batch_size, train=True)
        total = self._total_steps(train_loader)
        evaluate = self.eval_dataset is not None and strategy(a.eval_strategy) != "no"
        kwargs: dict[str, Any] = {}
        if evaluate and strategy(a.eval_strategy) == "steps":
            every = _interval(a.eval_steps or a.logging_steps, total)
            kwargs.update(
                val_check_interval=every * a.gradient_accumulation_steps, check_val_every_n_epoch=None
            )
        elif not evaluate:
            kwargs.update(limit_val_batches=0)
        self.state = TrainerState(max_steps=total, num_train_epochs=math.ceil(a.num_train_epochs))
        last = os.path.join(a.output_dir, "checkpoints", "last.ckpt")
        if resume_from_checkpoint is True and not os.path.exists(last):
            raise ValueError(f"mt.Trainer: no checkpoint to resume from: {last} does not exist.")
        self.trainer = self._lightning_trainer(
            max_steps=total,
            callbacks=with_progress_bar(self._callbacks(total), not a.disable_tqdm),
            # With save_strategy="no" nothing is saved: Lightning's own checkpointing would save the whole
            # model and its optimizer state.
            enable_checkpointing=strategy(a.save_strategy) in ("steps", "epoch"),
            accumulate_grad_batches=a.gradient_accumulation_steps,
            gradient_clip_val=a.max_grad_norm or None,
            log_every_n_steps=_log_interval(a.logging_steps, total),
            **kwargs,
        )
        self.module.loss_sum, self.module.loss_count = 0.0, 0
        self.trainer.fit(
            self.module,
            train_dataloaders=train_loader,
            # given even when not evaluated (limit_val_batches=0): Lightning warns of a step without data
            val_dataloaders=self._eval_loader() if self.eval_dataset is not None else None,
            ckpt_path="last" if resume_from_checkpoint is True else resume_from_checkpoint or None,
        )
        loss = self.module.loss_sum / max(self.module.loss_count, 1)
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items()}
        return TrainOutput(self.trainer.global_step, loss, dict(metrics, train_loss=loss))

    def save_model(self, output_dir: str | None = None) -> None:
        """The model as a Hugging Face directory (``from_pretrained`` reads it), by default ``output_dir``;
        its weights are read from megatrain's store."""
        self.model.save_pretrained(output_dir if output_dir is not None else self.args.output_dir)

    def evaluate(self, eval_dataset: Dataset | None = None) -> dict[str, float]:
        """Loss and perplexity on ``eval_dataset`` (default: the one given at construction)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("mt.Trainer.evaluate() needs an eval_dataset")
        self.trainer = self._lightning_trainer(enable_checkpointing=False)
        (metrics,) = self.trainer.validate(self.module, dataloaders=self._eval_loader(dataset), verbose=False)
        return _log(self.state, _eval_metrics(metrics))

    # -- building the Lightning pieces --

    def _lightning_trainer(self, **kwargs: Any) -> L.Trainer:
        a = self.args
        logging = strategy(a.logging_strategy) != "no"
        return L.Trainer(
            strategy=MegaTrainStrategy(**_STRATEGY_OPTIONS),
            accelerator="cpu" if a.use_cpu else "auto",
            devices=1,
            precision="bf16-mixed" if a.bf16 else "32-true",
            default_root_dir=a.output_dir,
            logger=CSVLogger(a.output_dir, name="logs") if logging else False,
            num_sanity_val_steps=0,
            enable_progress_bar=not a.disable_tqdm,
            deterministic=bool(a.full_determinism),
            **kwargs,
        )

    def _callbacks(self, total_steps: int) -> list[Callback]:
        a = self.args
        logging = strategy(a.logging_strategy) != "no"
        every = _log_interval(a.logging_steps, total_steps) if logging else None
        callbacks: list[Callback] = [MegaTrainMonitor(), _LogHistory(self.state, every)]
        if logging:
            callbacks.append(LearningRateMonitor(logging_interval="step"))
        save = strategy(a.save_strategy)
        if save in ("steps", "epoch"):
            every = {"every_n_train_steps": _interval(a.save_steps, total_steps)} if save == "steps" else {}
            callbacks.append(
                _SaveAsHuggingFace(
                    dirpath=os.path.join(a.output_dir, "checkpoints"),
                    filename="checkpoint-{step}",
                    auto_insert_metric_name=False,
                    monitor="step",
                    mode="max",
                    save_top_k=a.save_total_limit or -1,
                    save_last="link",  # a link to the newest checkpoint, not a second copy of it
                    **every,
                )
            )
        elif save != "no":
            warnings.warn(
                f"mt.Trainer ignores save_strategy={save!r}; use 'steps' or 'epoch'",
                UnsupportedArgumentWarning,
                stacklevel=3,
            )
        return callbacks

    def _loader(self, dataset: Dataset, batch_size: int, train: bool) -> DataLoader:
        a = self.args
        shuffle = train and getattr(a, "train_sampling_strategy", "random") != "sequential"
        seed = a.data_seed if a.data_seed is not None else a.seed
        workers = a.dataloader_num_workers
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            generator=torch.Generator().manual_seed(seed) if shuffle else None,
            collate_fn=self.collate,
            num_workers=workers,
            drop_last=a.dataloader_drop_last,
            pin_memory=a.dataloader_pin_memory and torch.cuda.is_available(),
            persistent_workers=a.dataloader_persistent_workers and workers > 0,
        )

    def _eval_loader(self, dataset: Dataset | None = None) -> DataLoader:
        dataset = dataset if dataset is not None else self.eval_dataset
        return self._loader(dataset, self.args.per_device_eval_batch_size, train=False)

    def _total_steps(self, loader: DataLoader) -> int:
        """Optimizer steps: ``max_steps`` if positive, else ``num_train_epochs`` (fractions allowed)."""
        a = self.args
        if a.max_steps > 0:
            return a.max_steps
        if not isinstance(loader.dataset, Sized):
            raise ValueError("a train_dataset without a length needs TrainingArguments(max_steps=...)")
        per_epoch = math.ceil(len(loader) / a.gradient_accumulation_steps)
        return max(1, math.ceil(a.num_train_epochs * per_epoch))


class _SaveAsHuggingFace(ModelCheckpoint):
    """``ModelCheckpoint`` that saves when Hugging Face's ``Trainer`` does: at each interval and at the last
    step, and never twice at one step. Lightning's alone saves again the step a run resumed from (at its
    first micro-batch when gradients accumulate: ``checkpoint-N-v1``, a copy of the whole model and
    optimizer state) and skips the last step when that is not on an interval and anything was saved."""

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._last_global_step_saved = trainer.global_step  # what a run resumed from is on disk already

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        super().on_train_end(trainer, pl_module)


def _eval_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    return {f"eval_{k.removeprefix('val_')}": float(v) for k, v in metrics.items() if k.startswith("val_")}


def _log(state: TrainerState, values: dict[str, float]) -> dict[str, float]:
    """An entry of ``state.log_history``, as Hugging Face's ``Trainer.log`` adds it: with epoch and step."""
    state.log_history.append({**values, "epoch": state.epoch, "step": state.global_step})
    return values


class _LogHistory(Callback):
    """Keeps Hugging Face's ``TrainerState`` of a run: the optimizer step, the epoch (fractional, as Hugging
    Face counts it) and ``log_history``: every ``every`` steps the mean training loss of the micro-batches
    since the last entry and the learning rate of the step, each evaluation's metrics, and at the end the
    run's time and mean loss."""

    def __init__(self, state: TrainerState, every: int | None) -> None:
        self.state = state
        self.every = every
        self._logged = (0.0, 0)  # the module's loss sum and count at the last entry
        self._lr = 0.0  # the learning rate of the step being taken
        self._start = time.perf_counter()

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.state.global_step = trainer.global_step  # a resumed run's
        self._start = time.perf_counter()

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        self._lr = optimizer.param_groups[0]["lr"]

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        state = self.state
        stepped = trainer.global_step != state.global_step
        state.global_step = trainer.global_step
        state.epoch = trainer.current_epoch + (batch_idx + 1) / trainer.num_training_batches
        if stepped and self.every and state.global_step % self.every == 0:
            total, count = pl_module.loss_sum, pl_module.loss_count
            (logged_total, logged_count), self._logged = self._logged, (total, count)
            _log(state, {"loss": (total - logged_total) / (count - logged_count), "learning_rate": self._lr})

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            _log(self.state, _eval_metrics(trainer.callback_metrics))

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        runtime = time.perf_counter() - self._start
        loss = pl_module.loss_sum / max(pl_module.loss_count, 1)
        _log(self.state, {"train_runtime": runtime, "train_loss": loss})
