"""Model configs and the Lightning module that wraps a Hugging Face causal LM.

``CausalLMModule`` never reads parameter values: under the megatrain strategy the parameters
live on the meta device and their data is paged in block by block, so the module only uses
names, shapes and ``ndim`` (e.g. for the optimizer's weight-decay groups).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

import lightning as L
import torch
from torchmetrics.text import Perplexity
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from megatrain_lightning.presets import resolve_config
from megatrain_lightning.serialization.hf import from_pretrained


def plain_container(value: Any) -> Any:
    """``value`` with omegaconf containers (what Hydra passes for ``betas: [0.9, 0.95]``) made plain
    lists and dicts, which a checkpoint loaded with ``torch.load(weights_only=True)`` may hold."""
    if "omegaconf" not in sys.modules:
        return value
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def warmup_cosine(warmup_steps: int, total_steps: int | None) -> Callable[[int], float]:
    """LR multiplier: linear warmup over ``warmup_steps``, then cosine decay to 0 at ``total_steps``.

    ``total_steps=None`` keeps the multiplier at 1 after warmup (the ``"constant"`` schedule). A
    function, which ``LambdaLR.state_dict()`` leaves out (as it does ``transformers``' schedulers): a
    resumed run follows its own length, so raising ``max_steps`` to train on does not resume at lr 0.
    """

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if total_steps is None:
            return 1.0
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier


class CausalLMModule(L.LightningModule):
    """A Hugging Face causal LM trained with AdamW.

    Args:
        model: A tiny arch name (see :func:`tiny_config`), a local Hugging Face model directory,
            a ``PretrainedConfig``, or an already built ``PreTrainedModel``. Unless given a built
            model, the model is created in :meth:`configure_model` (on the meta device under the
            megatrain strategy, which then fills the weights).
        lr: Peak learning rate.
        weight_decay: AdamW weight decay for parameters with ``ndim >= 2``; others get none.
        betas: AdamW betas.
        eps: AdamW epsilon.
        warmup_steps: Linear warmup steps.
        scheduler: ``"cosine"`` (to 0 at ``max_steps``) or ``"constant"`` (after warmup).
        max_steps: Length of the cosine schedule; ``None`` uses the trainer's
            ``estimated_stepping_batches``.
    """

    def __init__(
        self,
        model: str | Mapping[str, Any] | PretrainedConfig | PreTrainedModel = "llama",
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 0,
        scheduler: str = "cosine",
        max_steps: int | None = None,
    ) -> None:
        super().__init__()
        if scheduler not in ("cosine", "constant"):
            raise ValueError(f"scheduler must be 'cosine' or 'constant', got {scheduler!r}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.save_hyperparameters(ignore=["model"])
        for key, value in self.hparams.items():  # checkpoints load with weights_only=True
            self.hparams[key] = plain_container(value)
        self.model: PreTrainedModel | None = None
        self.pretrained_path: str | None = None
        if isinstance(model, PreTrainedModel):
            self.config: PretrainedConfig = model.config
            self.model = model
        else:
            self.config, self.pretrained_path = resolve_config(model)
        # What load_from_checkpoint needs to rebuild the model: its name or path, else its config.
        self.hparams["model"] = model if isinstance(model, str) else self.config.to_dict()
        self.val_ppl = Perplexity(ignore_index=-100)
        self.test_ppl = Perplexity(ignore_index=-100)

    def configure_model(self) -> None:
        """Build the model unless it exists; the strategy's init context decides where.

        Under megatrain parameters are created on meta and the strategy fills its store block by
        block: from the shards of a model directory (streamed, never the whole model in memory),
        or with the values a plain build draws from the same seed
        (:mod:`megatrain_lightning.serialization.initialization`).
        """
        if self.model is not None:
            return
        if self.pretrained_path is not None:
            self.model = from_pretrained(self.pretrained_path)
        else:
            self.model = AutoModelForCausalLM.from_config(self.config)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> Any:
        return self.model(input_ids=input_ids, labels=labels, attention_mask=attention_mask, use_cache=False)

    def _shared_eval(self, batch: dict[str, torch.Tensor], prefix: str, metric: Perplexity) -> torch.Tensor:
        out = self(batch["input_ids"], labels=batch["labels"], attention_mask=batch.get("attention_mask"))
        metric(out.logits[:, :-1].float(), batch["labels"][:, 1:])
        self.log(f"{prefix}_loss", out.loss, prog_bar=True, sync_dist=True)  # the mean over ranks
        self.log(f"{prefix}_ppl", metric)  # a torchmetrics metric syncs its own state
        return out.loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(
            batch["input_ids"], labels=batch["labels"], attention_mask=batch.get("attention_mask")
        ).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._shared_eval(batch, "val", self.val_ppl)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._shared_eval(batch, "test", self.test_ppl)

    def predict_step(self, batch: dict[str, torch.Tensor] | torch.Tensor, batch_idx: int) -> torch.Tensor:
        input_ids = batch["input_ids"] if isinstance(batch, Mapping) else batch
        return self(input_ids).logits.argmax(dim=-1)

    def param_groups(self) -> list[dict[str, Any]]:
        """AdamW groups: weight decay for ``ndim >= 2`` parameters, none for norms and biases.

        Parameters are de-duplicated by identity, so a tied weight appears once. Only shapes
        are read, never values (parameters may be on the meta device).
        """
        seen: set[int] = set()
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for _, p in self.named_parameters(remove_duplicate=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (decay if p.ndim >= 2 else no_decay).append(p)
        groups = [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return [g for g in groups if g["params"]]

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.param_groups(), lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps)
        if hp.scheduler == "constant":
            if hp.warmup_steps == 0:
                return {"optimizer": optimizer}
            total = None
        else:
            total = hp.max_steps
            if total is None:
                estimated = self.trainer.estimated_stepping_batches
                total = int(estimated) if math.isfinite(estimated) else None
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(hp.warmup_steps, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_start(self) -> None:
        """Set the learning rate of the step a run starts at from its schedule: a resumed run's optimizer
        state holds the rate its checkpoint's schedule gave (0 at a finished cosine's end), which the
        schedule's next step would only replace after one update."""
        for config in self.trainer.lr_scheduler_configs:
            s = config.scheduler
            if isinstance(s, torch.optim.lr_scheduler.LambdaLR):
                for group, base, f in zip(s.optimizer.param_groups, s.base_lrs, s.lr_lambdas, strict=True):
                    group["lr"] = base * f(s.last_epoch)
