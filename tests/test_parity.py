"""megatrain trains exactly like plain Lightning with torch's AdamW (CPU, fp32)."""

from __future__ import annotations

import pytest
from conftest import assert_same_training, fit, tiny_model

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.engine.blocks import discover_blocks

CASES = [
    # arch, activation checkpointing, accumulate_grad_batches, gradient clipping, zero copy (else slots)
    ("llama", True, 1, None, True),
    ("llama", False, 4, ("norm", 1.0), False),
    ("gpt2", True, 4, ("norm", 1.0), True),
    ("gpt2", False, 1, ("value", 0.02), False),
    ("qwen2_moe", True, 4, ("norm", 1.0), False),
    ("qwen2_moe", False, 1, None, True),
]


@pytest.mark.parametrize(("arch", "checkpointing", "accumulate", "clip", "zero_copy"), CASES)
def test_parity_with_plain_lightning(arch, checkpointing, accumulate, clip, zero_copy):
    model = tiny_model(arch)
    kwargs = {"accumulate_grad_batches": accumulate}
    if clip is not None:
        kwargs |= {"gradient_clip_algorithm": clip[0], "gradient_clip_val": clip[1]}
    plain = fit(model, "auto", **kwargs)
    strategy = MegaTrainStrategy(activation_checkpointing=checkpointing, zero_copy=zero_copy)
    paged = fit(model, strategy, **kwargs)
    assert_same_training(plain, paged)
    assert plain.losses[-1] < plain.losses[0]


def test_budget_of_two_blocks_bounds_the_slots_and_keeps_the_losses():
    model = tiny_model("llama", num_hidden_layers=18)
    largest_block = 4 * max(block.numel for block in discover_blocks(model))
    budget_gb = 2 * largest_block / 1e9
    model_bytes = 4 * sum(p.numel() for p in model.parameters())
    assert model_bytes >= 8 * budget_gb * 1e9
    plain = fit(model, "auto", steps=6)
    paged = fit(model, MegaTrainStrategy(max_vram_gb=budget_gb, zero_copy=False), steps=6)
    assert_same_training(plain, paged)
    stats = paged.trainer.strategy.stats
    assert 0 < stats.peak_slot_bytes <= budget_gb * 1e9
    assert paged.trainer.strategy.engine.pager.num_slots == 2
    # With two slots nearly every block is fetched twice per step: for forward and for backward
    # (only the blocks at the turn from forward to backward can stay resident).
    assert stats.h2d_bytes >= 6 * (2 * model_bytes - 4 * largest_block)
