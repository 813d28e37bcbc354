"""What the planner needs of a model: its paging blocks as the engine finds them and the sizes that drive
activations, from a model, a Hugging Face config, a ``config.json``, a model directory, a preset or the
name of one of the Hydra app's model configs."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from megatrain_lightning.engine.blocks import discover_blocks
from megatrain_lightning.engine.slots import mixed_fp32_numels
from megatrain_lightning.presets import llama_config, resolve_config, tiny_config

MASTER_BYTES = 4.0  # fp32 master weights in the store
PRESETS = ("tiny", "170m", "1b", "3b", "7b", "70b")
HYDRA_MODELS = Path(__file__).resolve().parents[1] / "configs" / "model"  # `megatrain-train model=NAME`


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: its paging blocks and the sizes that drive activations."""

    block_numels: tuple[int, ...]
    hidden_size: int
    mlp_width: int  # per token: the MLP's intermediate width (times the active experts for MoE)
    num_layers: int
    vocab_size: int
    # Per block, the elements that stay fp32 on the device under mixed precision (embeddings, norms,
    # biases: engine/slots.py); empty: none.
    fp32_numels: tuple[int, ...] = ()

    @property
    def num_params(self) -> int:
        return sum(self.block_numels)

    @property
    def largest_block(self) -> int:
        return max(self.block_numels)

    @property
    def num_blocks(self) -> int:
        return len(self.block_numels)

    def shadow_numel(self, dtype_bytes: int) -> int:
        """Parameters narrower than fp32 on the device in a compute dtype of ``dtype_bytes`` (none in fp32):
        what the host tier's shadow holds and the link carries at ``dtype_bytes`` each."""
        if dtype_bytes >= MASTER_BYTES:
            return 0
        kept = self.fp32_numels or (0,) * self.num_blocks
        return sum(n - k for n, k in zip(self.block_numels, kept, strict=True))

    def block_bytes(self, dtype_bytes: int) -> tuple[int, ...]:
        """Each block's bytes on the device in a compute dtype of ``dtype_bytes``, its fp32-kept parameters
        in fp32 when that dtype is narrower (the engine's layout may add a few hundred bytes of alignment
        between runs of different dtypes: engine/slots.py)."""
        kept = self.fp32_numels or (0,) * self.num_blocks
        wide = max(dtype_bytes, int(MASTER_BYTES))
        return tuple((n - k) * dtype_bytes + k * wide for n, k in zip(self.block_numels, kept, strict=True))

    @classmethod
    def from_module(cls, model: nn.Module, block_classes: Iterable[str | type] | None = None) -> ModelShape:
        """Blocks as the engine pages them (padding included); sizes from the Hugging Face config inside."""
        config = next(
            (m.config for m in model.modules() if isinstance(getattr(m, "config", None), PretrainedConfig)),
            None,
        )
        if config is None:
            raise ValueError(f"{type(model).__name__} holds no Hugging Face config to plan activations from")
        blocks = discover_blocks(model, block_classes)
        return cls.from_blocks([b.numel for b in blocks], config, mixed_fp32_numels(blocks))

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> ModelShape:
        """Build the model on the meta device (no memory, well under a second for 70B) and measure it."""
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return cls.from_module(model)

    @classmethod
    def from_blocks(
        cls, block_numels: Sequence[int], config: PretrainedConfig, fp32_numels: Sequence[int] = ()
    ) -> ModelShape:
        """From the engine's blocks (``[b.numel for b in blocks]``, and ``mixed_fp32_numels(blocks)``) and
        the model's (text) config; widths given per layer (Gemma-3n, Gemma-4) count at their largest. A model
        without a vocabulary (a vision or audio encoder: ``ViTConfig``) computes no logits."""
        config = config.get_text_config()
        hidden = config.hidden_size
        experts = _largest(getattr(config, "num_experts_per_tok", None)) or 1
        if getattr(config, "moe_intermediate_size", None):
            width = _largest(config.moe_intermediate_size) * experts
            width += _largest(getattr(config, "shared_expert_intermediate_size", None)) or 0
        else:
            width = (
                _largest(getattr(config, "intermediate_size", None))
                or _largest(getattr(config, "n_inner", None))
                or 4 * hidden
            ) * experts
        return cls(
            tuple(block_numels),
            hidden,
            width,
            getattr(config, "num_hidden_layers", None) or len(block_numels),
            getattr(config, "vocab_size", None) or 0,
            tuple(fp32_numels),
        )


def _largest(value: int | Sequence[int] | None) -> int | None:
    """A config width that may be given per layer."""
    if isinstance(value, (list, tuple)):
        return max(value, default=None)
    return value


def load_shape(model: ModelShape | PretrainedConfig | nn.Module | str | os.PathLike) -> ModelShape:
    """A :class:`ModelShape` from a shape, a config, a model, or a string naming a preset
    (``tiny``, ``170m``, ``1b``, ``7b``, ``70b``), a Hydra model config (``llama_7b``: :func:`hydra_models`),
    a ``config.json`` file or a model directory."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, nn.Module):
        return ModelShape.from_module(model)
    if isinstance(model, PretrainedConfig):
        return ModelShape.from_config(model)
    return ModelShape.from_config(_load_config(os.fspath(model)))


def hydra_models() -> tuple[str, ...]:
    """The Hydra app's model names, read from the configs the package ships, so that a user who trains with
    ``model=llama_7b`` can plan with the same name."""
    return tuple(sorted(path.stem for path in HYDRA_MODELS.glob("*.yaml")))


def _hydra_config(name: str) -> PretrainedConfig:
    """The config a Hydra model config's ``model`` builds, as the app builds it: an arch name or a directory
    (:func:`resolve_config`), or a ``_target_`` that returns a config."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    node = OmegaConf.load(HYDRA_MODELS / f"{name}.yaml")
    if OmegaConf.is_missing(node, "model"):
        raise ValueError(
            f"Hydra model {name!r} is a local model directory given as model.model=PATH: give that "
            "directory itself"
        )
    model = node.model
    return resolve_config(instantiate(model, _convert_="all") if OmegaConf.is_config(model) else model)[0]


def _accepted() -> str:
    return f"a preset ({', '.join(PRESETS)}), a Hydra model config ({', '.join(hydra_models())})"


def _load_config(spec: str) -> PretrainedConfig:
    if spec.lower() == "tiny":
        return tiny_config("llama")
    if spec.lower() in PRESETS:
        return llama_config(spec)
    if spec in hydra_models():
        return _hydra_config(spec)
    path = Path(spec)
    if path.is_file():
        try:
            return resolve_config(json.loads(path.read_text()))[0]
        except (ValueError, TypeError) as err:  # not JSON, not UTF-8, or JSON but no model config
            raise ValueError(
                f"model {spec!r} is a file but not a Hugging Face config.json ({err}); give {_accepted()}, "
                "a model's config.json or its directory"
            ) from err
    if path.is_dir():
        return AutoConfig.from_pretrained(path)
    raise ValueError(f"model {spec!r} is neither {_accepted()}, a config.json nor a directory")
