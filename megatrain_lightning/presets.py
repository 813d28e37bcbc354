"""Model configs by name: tiny ones for tests and examples, Llama-2-shaped ones for planning and
benchmarks. Pure Hugging Face configs (no Lightning, no weights), so the planner and the core can use
them without the application layer."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

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


# Llama-2-shaped configs ("1b" is the TinyLlama-1.1B shape and "3b" the OpenLLaMA-3B one: Llama-2 has
# neither size).
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
    "3b": dict(
        hidden_size=3200,
        intermediate_size=8640,
        num_hidden_layers=26,
        num_attention_heads=32,
        num_key_value_heads=32,
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
    """A Llama config of a standard shape: ``"170m"``, ``"1b"``, ``"3b"``, ``"7b"`` or ``"70b"``.

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
        if len(Path(model).parts) > 1 and not Path(model).exists():
            raise ValueError(
                f"model {model!r}: no such directory (nothing is downloaded: give a local Hugging Face model "
                f"directory, or a tiny arch: {', '.join(TINY_ARCHS)})"
            )
        raise ValueError(
            f"model {model!r} is neither a tiny arch ({', '.join(TINY_ARCHS)}) nor a directory "
            "holding a Hugging Face config.json"
        )
    raise TypeError(
        f"model must be a str, a PretrainedConfig or a PreTrainedModel, got {type(model).__name__}"
    )
