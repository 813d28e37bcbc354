"""Tiny configs for every decoder-only causal LM that ``AutoModelForCausalLM`` builds offline.

``tiny_zoo_config(model_type)`` starts from the config class's defaults and shrinks every usual
size field it has (hidden 64, 2+ layers, vocabulary 256, dropout 0, small MoE and MLA settings,
sliding windows shorter than the test sequences). Per-layer lists (``layer_types``,
``mlp_layer_types``, ...) keep one layer of each kind, so hybrid models keep every layer kind.
``ZOO_OVERRIDES`` holds the few fields a family needs on top; ``EXCLUDED`` names every
architecture left out, with the reason.
"""

from __future__ import annotations

from typing import Any

import torch

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
LAYERS = 2
VOCAB = 256
SEQ_LEN = 16
WINDOW = 8  # sliding windows shorter than the sequence, so the window mask matters

# field name -> tiny value, applied where the default config has the field and it is not None
_SIZES: dict[str, Any] = {
    **dict.fromkeys(
        ("hidden_size", "n_embd", "n_embed", "d_model", "emb_dim", "embedding_dim", "word_embed_proj_dim"),
        HIDDEN,
    ),
    **dict.fromkeys(
        ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_blocks"), LAYERS
    ),
    **dict.fromkeys(
        (
            "num_attention_heads",
            "n_head",
            "n_heads",
            "num_heads",
            "attention_heads",
            "decoder_attention_heads",
        ),
        HEADS,
    ),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "multi_query_group_num"), KV_HEADS),
    **dict.fromkeys(("head_dim", "dim_head", "d_head", "attention_head_size", "kv_channels"), HEAD_DIM),
    **dict.fromkeys(
        (
            "intermediate_size",
            "n_inner",
            "ffn_dim",
            "ffn_hidden_size",
            "d_ff",
            "dff",
            "d_inner",
            "dim_ff",
            "decoder_ffn_dim",
            "feed_forward_size",
        ),
        2 * HIDDEN,
    ),
    **dict.fromkeys(("moe_intermediate_size", "expert_intermediate_size"), HIDDEN // 2),
    **dict.fromkeys(("shared_expert_intermediate_size", "shared_experts_intermediate_size"), HIDDEN),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_k", "moe_topk", "num_experts_per_token", "top_k"), 2),
    **dict.fromkeys(("n_group", "topk_group", "num_expert_group"), 1),
    **dict.fromkeys(("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"), 1),
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    # multi-head latent attention
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 16,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "index_topk": 8,
    # linear attention and state-space layers
    "linear_key_head_dim": HEAD_DIM,
    "linear_value_head_dim": HEAD_DIM,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_head_dim": HEAD_DIM,
    "linear_num_heads": HEADS,
    "state_size": 8,
    "time_step_rank": 8,
    "mamba_d_state": 8,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_headdim": 16,
    "mamba_dt_rank": 8,
    "mamba_chunk_size": SEQ_LEN,
    "chunk_size": SEQ_LEN,
    "ssm_state_size": 8,
    "rotary_dim": 8,
    # positions and windows
    **dict.fromkeys(
        ("max_position_embeddings", "n_positions", "n_ctx", "context_length", "max_target_positions"), 64
    ),
    **dict.fromkeys(("sliding_window", "attention_window_size", "local_attention_window_len"), WINDOW),
    "vocab_size": VOCAB,
    "tie_word_embeddings": False,
    "use_cache": True,
    "output_router_logits": True,  # mixtures of experts train with their load-balancing loss, as recipes do
    "router_jitter_noise": 0.0,
    "input_jitter_noise": 0.0,
}

# Fields one family needs on top of the generic shrinking.
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_INKLING = dict(
    swa_num_attention_heads=HEADS,
    swa_num_key_value_heads=KV_HEADS,
    swa_head_dim=HEAD_DIM,
    sliding_window_size=WINDOW,
    rel_extent=SEQ_LEN,
)
ZOO_OVERRIDES: dict[str, dict[str, Any]] = {
    "bamba": dict(attn_layer_indices=[1]),
    "cohere_compass_text": dict(rope_parameters={"full_attention": _ROPE}),
    "dbrx": dict(
        attn_config=dict(kv_n_heads=KV_HEADS, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=2 * HIDDEN, moe_num_experts=4, moe_top_k=2),
    ),
    "deepseek_v2": dict(num_experts_per_tok=2, n_shared_experts=1),
    "deepseek_v4": dict(o_groups=2, o_lora_rank=16),
    "dory": dict(
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        n_input_layers=1,
        n_recurrent_layers=1,
        n_output_layers=1,
    ),
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),
    "dots3_note_text": dict(head_dim=HEAD_DIM, per_layer_config={}),
    "ergo": dict(first_dense_intermediate_size=2 * HIDDEN, shared_intermediate_size=HIDDEN),
    "falcon_h1": dict(mamba_d_ssm=2 * HIDDEN, mamba_n_heads=8, mamba_d_head=16),
    "gemma3n_text": dict(
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=16,
        laurel_rank=8,
        num_kv_shared_layers=0,
    ),
    "gemma4_text": dict(
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, per_layer_config={}
    ),
    "gemma4_unified_text": dict(per_layer_config={}),
    "gpt_neo": dict(
        attention_types=[[["global", "local"], 1]], attention_layers=["global", "local"], window_size=WINDOW
    ),
    "granitemoehybrid": dict(
        layer_types=["linear_attention", "full_attention"], shared_intermediate_size=HIDDEN
    ),
    "inkling_text": _INKLING,
    "inkling2_text": dict(_INKLING, unpadded_vocab_size=VOCAB),
    "inkling2_loop_text": dict(_INKLING, unpadded_vocab_size=VOCAB),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    # ``kv_source_layers`` names, per layer, the layer whose keys and values it reads: the layers are laid
    # out here, as the default's (an indexed layer that is no indexer reads an indexer's)
    "kolibri1_1": dict(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "indexed_attention"] * 2,
        index_layers=[1],
        kv_source_layers=[0, 1, 2, 1],
        mlp_only_layers=[0],
        mlp_only_intermediate_size=2 * HIDDEN,
        index_num_heads=2,
        index_pool_size=SEQ_LEN,
        index_compression=4,
        index_num_local_tokens=4,
        index_num_sink_tokens=2,
    ),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "longcat_flash": dict(expert_ffn_hidden_size=HIDDEN // 2, zero_expert_num=2, n_routed_experts=4),
    "minimax_m3_vl_text": dict(
        dense_intermediate_size=2 * HIDDEN,
        shared_intermediate_size=HIDDEN,
        index_block_size=4,
        index_topk_blocks=2,
    ),
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1),
    "nemotron_h": dict(
        mamba_num_heads=8, mamba_head_dim=16, n_groups=1, moe_shared_expert_intermediate_size=HIDDEN
    ),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "qwen4_exp_text": dict(
        hc_lowrank=16,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=4,
    ),
    "zaya": dict(num_experts_per_tok=1, router_hidden_size=32),
}

# Architectures in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES that the zoo leaves out, and why.
_ENCODER = "bidirectional encoder (a causal LM only as its `is_decoder` variant)"
_SEQ2SEQ = "decoder half of an encoder-decoder (sequence-to-sequence) model"
_MULTIMODAL = "multimodal: vision/audio towers from default sub-configs (llama4's needs over 20 GB)"
EXCLUDED: dict[str, str] = {
    **dict.fromkeys(
        (
            "bert",
            "bert-generation",
            "big_bird",
            "camembert",
            "data2vec-text",
            "electra",
            "ernie",
            "megatron-bert",
            "rembert",
            "roberta",
            "roberta-prelayernorm",
            "roc_bert",
            "roformer",
            "xlm-roberta",
            "xlm-roberta-xl",
            "xmod",
        ),
        _ENCODER,
    ),
    "xlm": "masked/translation language model (XLM), not a causal decoder",
    "xlnet": "permutation language model with two-stream attention, not a causal decoder",
    "reformer": "Reformer (LSH/local attention): needs `is_decoder=True` and axial position shapes whose product "
    "is the training sequence length",
    **dict.fromkeys(
        (
            "bart",
            "bigbird_pegasus",
            "blenderbot",
            "blenderbot-small",
            "marian",
            "mbart",
            "mvp",
            "pegasus",
            "plbart",
            "prophetnet",
            "trocr",
            "whisper",
        ),
        _SEQ2SEQ,
    ),
    **{
        name: f"{_MULTIMODAL}; its text model `{text}` is in the zoo"
        for name, text in (
            ("dots3_note", "dots3_note_text"),
            ("gemma3", "gemma3_text"),
            ("gemma3n", "gemma3n_text"),
            ("gemma4", "gemma4_text"),
            ("gemma4_unified", "gemma4_unified_text"),
            ("llama4", "llama4_text"),
            ("qwen3_5", "qwen3_5_text"),
            ("qwen3_5_moe", "qwen3_5_moe_text"),
            ("qwen4_exp", "qwen4_exp_text"),
        )
    },
    **dict.fromkeys(
        ("emu3", "fuyu", "git", "got_ocr2", "mllama", "moss_transcribe_diarize", "phi4_multimodal"),
        _MULTIMODAL,
    ),
    "xlstm": "the default call (`use_cache=True`) fails to backward in transformers itself, under plain "
    "PyTorch (its chunkwise kernel updates the recurrent state in place)",
    **dict.fromkeys(
        ("hrm_text", "zaya"),
        "the module holding the layers owns parameters itself (HRM's `z_L_init`, ZAYA's input scale): "
        "megatrain refuses it with a clear error naming `block_classes` (tests/test_blocks.py)",
    ),
    "kolibri1_1": "its layers read keys and values that another layer computed (`kv_source_layers`): "
    "megatrain refuses it with a clear error (tests/test_blocks.py)",
    "blt": "Byte Latent Transformer: entropy patcher plus local encoder/decoder and global sub-models (four sub-configs)",
    "musicgen": "audio-codebook decoder: takes (batch x codebooks) token ids and a text-encoder config",
    "musicgen_melody": "audio-codebook decoder: takes (batch x codebooks) token ids and a text-encoder config",
    **dict.fromkeys(
        ("gemma4_assistant", "gemma4_unified_assistant"),
        "speculative-decoding drafter: runs on the target model's hidden states",
    ),
}


# Architectures that use a layer's output again outside the next layer's call: autograd adds that use's
# gradient to the next layer's one use at a time, megatrain adds the next layer's uses up first (engine/
# shared_inputs.py carries sums between layers' calls, not from uses outside them). They train within a
# rounding (1e-6) of plain Lightning.
_BLOCK_RESIDUALS = (
    "each layer's output is also concatenated into the block states every later layer attends over (block "
    "attention residuals)"
)
SUMMED_APART: dict[str, str] = dict.fromkeys(("inkling2_text", "inkling2_loop_text"), _BLOCK_RESIDUALS)

_PER_LAYER_VALUES = ("no_rope_layers", "activation_sparsity_pattern", "intermediate_size")
_NONE_MEANS_DERIVED = ("head_dim", "num_key_value_heads")  # None is "derive it", our value is the same


def _is_per_layer(name: str, value: Any, num_layers: int) -> bool:
    """A list with one entry per layer (``layer_types``, ``mlp_layer_types``, ``no_rope_layers``, ...)."""
    return (
        isinstance(value, list)
        and len(value) == num_layers
        and (name.endswith(("_types", "block_type")) or name in _PER_LAYER_VALUES)
    )


def _is_layer_index_list(name: str, value: Any, num_layers: int) -> bool:
    """A list of layer indices (``moe_layers``, ``full_attn_idxs``, ``attn_layer_indices``, ...)."""
    return (
        isinstance(value, list)
        and name.endswith(("_layers", "_idxs", "_indices", "_ids"))
        and all(isinstance(i, int) and 0 <= i < num_layers for i in value)
    )


def _layer_pick(defaults: dict[str, Any], num_layers: int) -> list[int]:
    """Indices of the default config's layers to keep: the first layer of each kind that a per-layer
    list or a layer-index list tells apart, at least ``LAYERS`` of them."""
    keep: set[int] = set()
    for name, value in defaults.items():
        if _is_per_layer(name, value, num_layers):
            firsts: dict[str, int] = {}
            for index, item in enumerate(value):
                firsts.setdefault(repr(item), index)
            keep.update(firsts.values())
        elif _is_layer_index_list(name, value, num_layers) and value:
            keep.add(min(value))
            keep.add(next((i for i in range(num_layers) if i not in value), min(value)))
    for index in range(num_layers):
        if len(keep) >= LAYERS:
            break
        keep.add(index)
    return sorted(keep)


def _is_dropout(name: str, value: Any) -> bool:
    return isinstance(value, float) and ("dropout" in name or "pdrop" in name or name.endswith("layerdrop"))


def tiny_zoo_config(model_type: str, dropout: bool = False) -> Any:
    """A tiny config of ``model_type`` with a 256-token vocabulary, dropout-free unless ``dropout`` (then
    the config's own)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    kwargs: dict[str, Any] = {}
    for name, value in defaults.items():
        if name in _SIZES and (value is not None or name in _NONE_MEANS_DERIVED):
            kwargs[name] = _SIZES[name]
        elif _is_dropout(name, value) and not dropout:
            kwargs[name] = 0.0
        elif name.endswith("_token_id") and value is not None:
            ids = [
                i if 0 <= i < VOCAB else VOCAB - 1 for i in (value if isinstance(value, list) else [value])
            ]
            kwargs[name] = ids if isinstance(value, list) else ids[0]
    if "kv_lora_rank" in kwargs:  # multi-head latent attention: one key per query head
        kwargs.update({n: v for n, v in (("head_dim", 8), ("num_key_value_heads", HEADS)) if n in kwargs})
    layer_fields = [n for n in ("num_hidden_layers", "n_layer", "n_layers", "num_layers") if n in defaults]
    num_layers = defaults[layer_fields[0]] if layer_fields else 0
    pick = _layer_pick(defaults, num_layers)
    for name, value in defaults.items():
        if _is_per_layer(name, value, num_layers):
            kwargs[name] = [_SIZES.get(name, value[i]) for i in pick]
        elif _is_layer_index_list(name, value, num_layers):
            kwargs[name] = [new for new, old in enumerate(pick) if old in value]
        elif (
            isinstance(value, dict) and value and all(isinstance(k, str) and k.isdigit() for k in value)
        ):  # per-layer overrides
            kwargs[name] = {
                f"{new:02d}": value[f"{old:02d}"] for new, old in enumerate(pick) if f"{old:02d}" in value
            }
    kwargs.update(dict.fromkeys(layer_fields, len(pick)))
    kwargs.update(ZOO_OVERRIDES.get(model_type, {}))
    return cls(**kwargs)


def tiny_zoo_model(model_type: str, seed: int = 0, dropout: bool = False) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_zoo_config(model_type, dropout))


def included_archs() -> list[str]:
    """The zoo: every name of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` not in ``EXCLUDED``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(EXCLUDED))


def dropout_archs() -> list[str]:
    """The zoo's architectures whose config has dropout on by default (GPT-2's, OPT's, ...)."""
    from transformers import CONFIG_MAPPING

    return [
        arch
        for arch in included_archs()
        if any(
            _is_dropout(name, value) and value > 0 for name, value in CONFIG_MAPPING[arch]().to_dict().items()
        )
    ]


def router_logits_archs() -> list[str]:
    """The zoo's mixtures of experts: the architectures whose config has ``output_router_logits``."""
    return [a for a in included_archs() if hasattr(tiny_zoo_config(a), "output_router_logits")]


def readme_section() -> str:
    """The README's list of architectures, between its ``<!-- zoo -->`` markers."""
    import transformers

    archs = included_archs()
    lines = [
        f"**Architectures** (`tests/test_zoo.py`, transformers {transformers.__version__}, tiny configs): "
        f"these {len(archs)} causal LMs train like plain Lightning under the model's default call, with and "
        f"without activation checkpointing, bitwise but for {len(SUMMED_APART)} (below): {', '.join(archs)}. "
        "The mixtures of experts among them "
        f"({len(router_logits_archs())}) train with `output_router_logits=True`, their load-balancing loss "
        "where the model computes one.",
        "",
        "These train within a rounding (1e-6) of plain Lightning: a layer's output is used again outside the "
        "next layer's call, and autograd adds that use's gradient to the next layer's one use at a time, "
        "megatrain adds the next layer's uses up first:",
        *(f"- {name}: {reason}." for name, reason in SUMMED_APART.items()),
        "",
        "Left out:",
    ]
    by_reason: dict[str, list[str]] = {}
    for name, reason in sorted(EXCLUDED.items()):
        by_reason.setdefault(reason, []).append(name)
    lines += [f"- {', '.join(names)}: {reason}." for reason, names in by_reason.items()]
    return "\n".join(lines)
