"""The CI-sized guard of the headline: a model whose training state is ten times the host cache, with a
block larger than half of it, trains on the disk tier bitwise like plain Lightning, and the process grows
by no more than the cache, the slots and a fixed overhead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import UserLM, assert_same_training, peak_rss_script, tiny_model, user_fit
from lightning.fabric.utilities.exceptions import MisconfigurationException
from transformers import AutoModelForCausalLM

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.engine.blocks import discover_blocks
from megatrain_lightning.planner.plan import Machine, plan_for
from megatrain_lightning.planner.table import format_plan
from megatrain_lightning.presets import tiny_config
from megatrain_lightning.store import sizing

CACHE_GB = 0.06
CHUNK_MB = 1.0
STEPS = 3
# Seven Llama layers of 7.7M parameters (30.7 MB of fp32 each, more than half the cache).
SHAPE = dict(
    hidden_size=768, intermediate_size=2304, num_hidden_layers=7, num_attention_heads=8, num_key_value_heads=8
)
# Beyond the cache and the slots (measured: 78 MB): one block's gradients on the (CPU) device, activations, Lightning's
# own state, thread stacks and allocator slack.
FIXED_OVERHEAD = 150e6


class ConfiguredLM(UserLM):
    """:class:`UserLM` whose model is built in ``configure_model``: on meta under megatrain, which
    initializes it block by block straight into the disk store, as a plain build with the same seed."""

    def __init__(self, config) -> None:
        super().__init__(None)
        self.config = config

    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)
            self.model = AutoModelForCausalLM.from_config(self.config)


SCRIPT = peak_rss_script(
    """
    import json, sys, time, torch
    tests, folder, out = sys.argv[1:4]
    sys.path.insert(0, tests)
    import megatrain_lightning
    from conftest import user_fit
    from test_scale import CACHE_GB, CHUNK_MB, SHAPE, STEPS, ConfiguredLM
    from megatrain_lightning.presets import tiny_config

    config = tiny_config("llama", **SHAPE)
    PEAK_RSS_WATCHER
    slots_gb = 2 * 4 * 7.7e6 / 1e9
    strategy = megatrain_lightning.MegaTrainStrategy(
        offload_dir=folder, max_cpu_gb=CACHE_GB, max_vram_gb=slots_gb, io_chunk_mb=CHUNK_MB
    )
    run = user_fit(config, strategy, steps=STEPS, module_cls=ConfiguredLM)
    time.sleep(0.05)
    figures = {"baseline": baseline, "peak": peak["rss"],
               "slots": strategy.engine.pager.nbytes,
               "cache_peak": strategy.stats.peak_host_cache_bytes}
    torch.save({"losses": run.losses, "state": run.state_dict()}, out)
    print(json.dumps(figures))
    """
)


def test_a_model_ten_times_the_cache_trains_exactly_within_the_memory_bound(tmp_path):
    config = tiny_config("llama", **SHAPE)
    blocks = discover_blocks(AutoModelForCausalLM.from_config(config))
    params = sum(b.numel for b in blocks)
    assert 16 * params >= 10 * CACHE_GB * 1e9  # weights, gradients, m and v in fp32
    assert 4 * max(b.numel for b in blocks) > CACHE_GB * 1e9 / 2
    assert (
        sizing.min_cache_bytes(max(b.numel for b in blocks), 1, int(CHUNK_MB * 2**20) // 4) < CACHE_GB * 1e9
    )

    out = subprocess.run(
        [
            sys.executable,
            "-c",
            SCRIPT,
            os.path.dirname(__file__),
            str(tmp_path / "store"),
            str(tmp_path / "run.pt"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["cache_peak"] <= CACHE_GB * 1e9
    grown = figures["peak"] - figures["baseline"]
    assert grown <= CACHE_GB * 1e9 + figures["slots"] + FIXED_OVERHEAD, figures

    saved = torch.load(tmp_path / "run.pt")
    paged = SimpleNamespace(losses=saved["losses"], state_dict=lambda: saved["state"])
    plain = user_fit(config, steps=STEPS, module_cls=ConfiguredLM)
    assert_same_training(plain, paged)


def test_a_cache_below_the_chunks_in_use_is_refused_with_the_least_it_needs(tmp_path):
    model = tiny_model("llama")
    largest = max(b.numel for b in discover_blocks(model))
    least = sizing.min_cache_bytes(largest, cuda=False)
    strategy = MegaTrainStrategy(offload_dir=tmp_path / "store", max_cpu_gb=least / 2 / 1e9)
    with pytest.raises(MisconfigurationException, match=f"needs at least {least / 1e9:.3g} GB"):
        user_fit(model, strategy, steps=1)
    assert not (tmp_path / "store").exists()
    plan = format_plan(plan_for(model, Machine(vram_gb=1, ram_gb=1e-4, disk_gb=1)))  # a GPU machine
    assert f"`max_cpu_gb` >= {sizing.min_cache_bytes(largest) / 1e9:.2g} GB" in plan
