"""Hugging Face models beside the causal LMs, fine-tuned the way users fine-tune them: a reward model, a
classifier with its config's dropout, encoder-decoders (every decoder layer reads the encoder's output), a
masked LM, a vision encoder. Each trains bitwise like plain Lightning, the model's default call on dict
batches."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import transformers as T
from conftest import assert_same_training, user_fit

from megatrain_lightning import MegaTrainStrategy

VOCAB, BATCH, SEQ = 64, 2, 8
SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
SEQ2SEQ = dict(vocab_size=VOCAB, d_model=32, pad_token_id=0, decoder_start_token_id=0)


def _reward_model() -> torch.nn.Module:
    config = T.LlamaConfig(vocab_size=VOCAB, num_key_value_heads=2, pad_token_id=0, num_labels=1, **SIZES)
    return T.LlamaForSequenceClassification(config)


def _gpt2_classifier() -> torch.nn.Module:  # GPT2Config's dropout (attention's included) left on
    config = T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, pad_token_id=0, num_labels=3)
    return T.GPT2ForSequenceClassification(config)


def _t5(dropout_rate: float = 0.1) -> torch.nn.Module:
    config = T.T5Config(d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=dropout_rate, **SEQ2SEQ)
    return T.T5ForConditionalGeneration(config)


def _bart() -> torch.nn.Module:
    layers = dict(encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4)
    config = T.BartConfig(encoder_ffn_dim=64, decoder_ffn_dim=64, **layers, **SEQ2SEQ)
    return T.BartForConditionalGeneration(config)


def _bert_mlm() -> torch.nn.Module:
    return T.BertForMaskedLM(T.BertConfig(vocab_size=VOCAB, **SIZES))


def _vit() -> torch.nn.Module:  # its config has no vocabulary
    return T.ViTForImageClassification(T.ViTConfig(image_size=16, patch_size=4, num_labels=3, **SIZES))


def _batch(kind: str, generator: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator)
    if kind == "image":
        return {
            "pixel_values": torch.randn(BATCH, 3, 16, 16, generator=generator),
            "labels": torch.randint(0, 3, (BATCH,), generator=generator),
        }
    if kind == "seq2seq":
        return {"input_ids": ids, "labels": torch.randint(1, VOCAB, (BATCH, 5), generator=generator)}
    if kind == "masked":
        labels = torch.full_like(ids, -100)
        labels[:, 2::3] = ids[:, 2::3]
        return {"input_ids": ids.index_fill(1, torch.arange(2, SEQ, 3), 1), "labels": labels}
    ids[0, -2:] = 0  # a padded row: the classifier reads each row's last token
    if kind == "score":
        scores = torch.randn(BATCH, generator=generator)
    else:
        scores = torch.randint(0, 3, (BATCH,), generator=generator)
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": scores}


HEADS: dict[str, tuple[Callable[[], torch.nn.Module], str]] = {
    "reward-model": (_reward_model, "score"),
    "gpt2-classifier-dropout": (_gpt2_classifier, "class"),
    "t5": (_t5, "seq2seq"),
    "t5-without-dropout": (functools.partial(_t5, dropout_rate=0.0), "seq2seq"),
    "bart": (_bart, "seq2seq"),
    "bert-masked-lm": (_bert_mlm, "masked"),
    "vit": (_vit, "image"),
}


# Every head with the block recompute; without it, those whose layers' recompute mattered; T5 under
# bf16-mixed without dropout (its cross-attention bias, which takes no gradient, picks the CPU attention
# kernel; with dropout one kernel computes either way).
CASES = [(head, True, "32-true") for head in HEADS if head != "t5-without-dropout"] + [
    ("t5", False, "32-true"),
    ("gpt2-classifier-dropout", False, "32-true"),
    ("t5-without-dropout", True, "bf16-mixed"),
]


@pytest.mark.parametrize(
    ("head", "checkpointing", "precision"),
    CASES,
    ids=[f"{h}-{'recompute' if c else 'once'}{'' if p == '32-true' else '-' + p}" for h, c, p in CASES],
)
def test_other_heads_train_bitwise_like_plain_lightning(head, checkpointing, precision):
    build, kind = HEADS[head]
    torch.manual_seed(0)
    model = build()
    generator = torch.Generator().manual_seed(1)
    batches = [_batch(kind, generator) for _ in range(3)]
    plain = user_fit(model, "auto", steps=3, batches=batches, precision=precision)
    strategy = MegaTrainStrategy(activation_checkpointing=checkpointing)
    paged = user_fit(model, strategy, steps=3, batches=batches, precision=precision)
    assert_same_training(plain, paged)
