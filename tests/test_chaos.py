"""Chaos (issue 17): the same weights under random delays at every hand-off, kills and disk faults.

Short versions of ``benchmarks/chaos.py`` (a few seeds, a few kills, a few faults); the injector is
:mod:`megatrain_lightning.engine.chaos`."""

from __future__ import annotations

import pytest
import torch
from conftest import Run, assert_same_training, tiny_model, user_fit

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.engine import chaos

STEPS = 4
SEEDS = (1, 2)
TWO_SLOTS = 3.2e-4  # max_vram_gb: two slots of the tiny Llama, so blocks are evicted and prefetched
SMALL_CACHE = 1.4e-3  # max_cpu_gb: weights, gradients and state go to disk and come back every step

# (tier, optimizer state, Trainer options): each of host/disk, fp32/int4, clipping, accumulation
CASES = [
    ("host", "none", {}),
    ("disk", "none", {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2}),
    ("host", "int4", {"gradient_clip_val": 0.05}),
    ("disk", "int4", {"accumulate_grad_batches": 2}),
]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model("llama")


def strategy(tier: str, compression: str, offload_dir) -> MegaTrainStrategy:
    disk = {"offload_dir": offload_dir, "max_cpu_gb": SMALL_CACHE} if tier == "disk" else {}
    return MegaTrainStrategy(max_vram_gb=TWO_SLOTS, optimizer_compression=compression, **disk)


def assert_bitwise(expected: Run, actual: Run) -> None:
    assert actual.losses == expected.losses
    want, got = expected.state_dict(), actual.state_dict()
    assert want.keys() == got.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{name} differs"


@pytest.mark.parametrize(("tier", "compression", "options"), CASES, ids=lambda c: str(c))
def test_random_delays_give_the_same_weights(model, tmp_path, tier, compression, options):
    reference = user_fit(model, strategy(tier, compression, tmp_path / "calm"), steps=STEPS, **options)
    assert len(reference.losses) == STEPS * options.get("accumulate_grad_batches", 1)
    if compression == "none":
        assert_same_training(user_fit(model, "auto", steps=STEPS, **options), reference, 0.0, 0.0)
    for seed in SEEDS:
        with chaos.enabled(f"seed={seed},delay_ms=20,p=0.3") as injected:
            run = user_fit(model, strategy(tier, compression, tmp_path / f"seed{seed}"), steps=STEPS, **options)
        assert sum(injected.hits.values()) > 50  # the points were hit (and slept at random)
        assert_bitwise(reference, run)
