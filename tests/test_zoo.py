"""The architecture zoo: every decoder-only causal LM that transformers builds offline trains under
megatrain exactly like under plain Lightning, called the way users call it (the model's default
call, so ``use_cache`` stays at the config's default), with and without activation checkpointing:
bitwise, the models of ``zoo.SUMMED_APART`` within a rounding.

Architectures left out are listed with their reason in ``zoo.EXCLUDED``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import Run, assert_same_training, user_fit
from lightning.fabric.utilities.exceptions import MisconfigurationException
from transformers import AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from zoo import EXCLUDED, SUMMED_APART, dropout_archs, included_archs, tiny_zoo_config, tiny_zoo_model

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.serialization.initialization import InitRecorder, initialize
from megatrain_lightning.serialization.meta import init_on_meta

ARCHS = included_archs()
# Padded dict batches (attention_mask, -100 labels) for families whose masks are built differently:
# SDPA causal, sliding windows, ALiBi, chunked attention, state-space and recurrent layers.
PADDED = ("llama", "gpt2", "mistral", "gemma3_text", "bloom", "falcon", "llama4_text", "jamba", "qwen3_next")


@pytest.fixture(scope="module")
def plain_runs() -> dict[tuple[str, bool], tuple[torch.nn.Module, Run]]:
    """Each architecture's tiny model and its run under the default strategy, built once per module."""
    return {}


def _plain(
    runs: dict[tuple[str, bool], tuple[torch.nn.Module, Run]], arch: str, dicts: bool
) -> tuple[torch.nn.Module, Run]:
    """``arch``'s tiny model and its run under the default strategy, which megatrain's must equal."""
    if (arch, dicts) not in runs:
        model = tiny_zoo_model(arch)
        assert sum(p.numel() for p in model.parameters()) < 1_000_000, f"the tiny {arch} is not tiny"
        runs[arch, dicts] = model, user_fit(model, "auto", dicts=dicts)
    return runs[arch, dicts]


def _assert_as_plain(arch: str, plain: Run, paged: Run) -> None:
    tolerance = 1e-6 if arch in SUMMED_APART else 0.0
    assert_same_training(plain, paged, loss_rtol=tolerance, param_atol=tolerance)


def test_the_zoo_covers_the_decoder_only_architectures():
    assert len(ARCHS) >= 60
    assert set(EXCLUDED) <= set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), "stale entries in zoo.EXCLUDED"
    assert set(PADDED) <= set(ARCHS)


@pytest.mark.parametrize("arch", ARCHS)
def test_zoo_with_activation_checkpointing(arch, plain_runs):
    model, plain = _plain(plain_runs, arch, dicts=False)
    paged = user_fit(model, MegaTrainStrategy(activation_checkpointing=True))
    _assert_as_plain(arch, plain, paged)


@pytest.mark.parametrize("arch", ARCHS)
def test_zoo_without_activation_checkpointing(arch, plain_runs):
    model, plain = _plain(plain_runs, arch, dicts=False)
    paged = user_fit(model, MegaTrainStrategy(activation_checkpointing=False))
    _assert_as_plain(arch, plain, paged)


@pytest.mark.parametrize("arch", PADDED)
def test_zoo_padded_dict_batches(arch, plain_runs):
    model, plain = _plain(plain_runs, arch, dicts=True)
    paged = user_fit(model, MegaTrainStrategy(activation_checkpointing=True), dicts=True)
    _assert_as_plain(arch, plain, paged)


@pytest.mark.parametrize("arch", dropout_archs())
def test_zoo_with_the_configs_own_dropout(arch):
    """The configs' own dropout (the zoo's others are dropout-free): the recompute replays each mask. (The
    cache's layout, which GPT-2's attention dropout is sensitive to, rounds alike at these sizes:
    tests/test_heads.py's GPT-2 classifier is where it showed.)"""
    model = tiny_zoo_model(arch, dropout=True)
    plain = user_fit(model, "auto")
    _assert_as_plain(arch, plain, user_fit(model, MegaTrainStrategy()))


def test_zoo_meta_builds_start_from_the_plain_builds_weights():
    """Every architecture built on meta with megatrain's recorder, then replayed module by module, equals
    its plain build with the same seed (ModernBERT's `trunc_normal_`, which returns at once on meta, and
    RWKV's `torch.tensor(..., device=w.device)` included)."""
    differs, refused = set(), set()
    for arch in ARCHS:
        torch.manual_seed(0)
        plain = AutoModelForCausalLM.from_config(tiny_zoo_config(arch))
        torch.manual_seed(0)
        try:
            with init_on_meta(), InitRecorder() as recorder:
                built = AutoModelForCausalLM.from_config(tiny_zoo_config(arch))
        except MisconfigurationException:
            refused.add(arch)
            continue
        recorder.install(built)
        built.to_empty(device="cpu")
        built.tie_weights()
        for module in reversed(list(built.modules())):
            initialize(module, model_init=built._init_weights)
        expected, actual = dict(plain.named_parameters()), dict(built.named_parameters())
        if not all(torch.equal(expected[name], actual[name]) for name in expected):
            differs.add(arch)
    assert (differs, refused) == (set(), set())
