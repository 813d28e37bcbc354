"""Model configs and the Lightning module that wraps a Hugging Face causal LM.

``CausalLMModule`` never reads parameter values: under the megatrain strategy the parameters
live on the meta device and their data is paged in block by block, so the module only uses
names, shapes and ``ndim`` (e.g. for the optimizer's weight-decay groups).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torchmetrics.text import Perplexity
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from megatrain_lightning.hf import from_pretrained
from megatrain_lightning.init import InitRecorder
from megatrain_lightning.meta import building_on_meta

TINY_ARCHS = ("llama", "gpt2", "qwen2_moe", "mixtral")
BYTE_VOCAB = 256


def tiny_config(arch: str, **overrides: Any) -> PretrainedConfig:
    """A tiny, dropout-free config for a byte-level LM (vocabulary 256), for tests and examples.

    Args:
        arch: One of ``"llama"``, ``"gpt2"`` (tied embeddings), ``"qwen2_moe"``, ``"mixtral"``.
        **overrides: Config fields that replace the defaults, e.g. ``num_hidden_layers=4``.
    """
    from transformers import GPT2Config, LlamaConfig, MixtralConfig, Qwen2MoeConfig

    common = dict(vocab_size=BYTE_VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    llama_like = dict(
        common,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        kwargs: dict[str, Any] = dict(llama_like, rms_norm_eps=1e-5)
        cls: type[PretrainedConfig] = LlamaConfig
    elif arch == "gpt2":
        kwargs = dict(
            common,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=512,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            summary_first_dropout=0.0,
        )
        cls = GPT2Config
    elif arch == "qwen2_moe":
        kwargs = dict(
            llama_like,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            output_router_logits=False,
        )
        cls = Qwen2MoeConfig
    elif arch == "mixtral":
        kwargs = dict(
            llama_like,
            num_local_experts=4,
            num_experts_per_tok=2,
            router_jitter_noise=0.0,
            output_router_logits=False,
        )
        cls = MixtralConfig
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {', '.join(TINY_ARCHS)}")
    kwargs.update(overrides)
    return cls(**kwargs)


# Llama-2-shaped configs ("1b" is the TinyLlama-1.1B shape: Llama-2 has no 1B model).
_LLAMA_SHAPES: dict[str, dict[str, int]] = {
    "170m": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=2048,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    ),
    "7b": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
    ),
    "70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=4096,
    ),
}


def llama_config(size: str, **overrides: Any) -> PretrainedConfig:
    """A Llama config of a standard shape: ``"170m"``, ``"1b"``, ``"7b"`` or ``"70b"``.

    Vocabulary 32000, untied embeddings, RMSNorm eps 1e-5, no dropout. ``overrides`` replace
    any field (e.g. ``vocab_size=256`` for the byte tokenizer).
    """
    from transformers import LlamaConfig

    key = size.lower()
    if key not in _LLAMA_SHAPES:
        raise ValueError(f"unknown Llama size {size!r}; choose one of {', '.join(_LLAMA_SHAPES)}")
    kwargs: dict[str, Any] = dict(
        _LLAMA_SHAPES[key],
        vocab_size=32000,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def plain_container(value: Any) -> Any:
    """``value`` with omegaconf containers (what Hydra passes for ``betas: [0.9, 0.95]``) made plain
    lists and dicts, which a checkpoint loaded with ``torch.load(weights_only=True)`` may hold."""
    if "omegaconf" not in sys.modules:
        return value
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def resolve_config(model: str | Mapping[str, Any] | PretrainedConfig) -> tuple[PretrainedConfig, str | None]:
    """Return ``(config, pretrained_dir)`` for an arch name, a model directory, a dict or a config.

    ``pretrained_dir`` is the directory when ``model`` names a local Hugging Face model directory
    (one holding ``config.json``), else ``None``.
    """
    if isinstance(model, PretrainedConfig):
        return model, None
    if isinstance(model, Mapping):
        kwargs = dict(model)
        model_type = kwargs.pop("model_type", None)
        if model_type is None:
            raise ValueError("a config dict needs a 'model_type' key (as PretrainedConfig.to_dict() gives)")
        return AutoConfig.for_model(model_type, **kwargs), None
    if isinstance(model, str):
        if model in TINY_ARCHS:
            return tiny_config(model), None
        if (Path(model) / "config.json").is_file():
            return AutoConfig.from_pretrained(model), model
        raise ValueError(
            f"model {model!r} is neither a tiny arch ({', '.join(TINY_ARCHS)}) nor a directory "
            "holding a Hugging Face config.json"
        )
    raise TypeError(
        f"model must be a str, a PretrainedConfig or a PreTrainedModel, got {type(model).__name__}"
    )


class WarmupCosine:
    """LR multiplier: linear warmup over ``warmup_steps``, then cosine decay to 0 at ``total_steps``.

    ``total_steps=None`` keeps the multiplier at 1 after warmup (the ``"constant"`` schedule).
    A callable object (not a lambda) so ``LambdaLR.state_dict()`` saves it.
    """

    def __init__(self, warmup_steps: int, total_steps: int | None) -> None:
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.total_steps is None:
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return 0.5 * (1.0 + math.cos(math.pi * progress))


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
        or with the values a plain build draws from the same seed (see :mod:`megatrain_lightning.init`).
        """
        if self.model is not None:
            return
        if self.pretrained_path is not None:
            self.model = from_pretrained(self.pretrained_path)
        elif building_on_meta():  # the store is filled later: with what a plain build would draw
            with InitRecorder() as recorder:
                self.model = AutoModelForCausalLM.from_config(self.config)
            recorder.install(self.model)
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
        self.log(f"{prefix}_loss", out.loss, prog_bar=True)
        self.log(f"{prefix}_ppl", metric)
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
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(hp.warmup_steps, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
