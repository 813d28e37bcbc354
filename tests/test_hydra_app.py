"""The Hydra app and its configs, found through the package's Hydra search-path plugin."""

from __future__ import annotations

import contextlib
import csv
import inspect
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import pytest
from conftest import fit, tiny_model
from entry_points import run_command
from hydra import compose, initialize
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import OmegaConf

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.data import TextDataModule
from megatrain_lightning.models import CausalLMModule

REPO = Path(__file__).resolve().parents[1]
USER_APP = textwrap.dedent(
    """
    import hydra
    from omegaconf import DictConfig

    from megatrain_lightning.train import run


    @hydra.main(version_base="1.3", config_path=None, config_name="train")
    def main(cfg: DictConfig) -> None:
        run(cfg)


    if __name__ == "__main__":
        main()
    """
)
FAST = [
    "data.seq_len=32",
    "data.batch_size=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "+trainer.enable_progress_bar=false",
    "+trainer.enable_model_summary=false",
]


def _env_without_repo() -> dict[str, str]:
    """The installed package only: no PYTHONPATH pointing into the checkout."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@pytest.fixture
def plugin_configs():
    """Compose with no config dir of our own: everything comes from the plugin's pkg:// path."""
    GlobalHydra.instance().clear()
    with initialize(version_base="1.3", config_path=None):
        yield
    GlobalHydra.instance().clear()


def test_plugin_is_discovered_and_registers_the_strategy():
    from hydra.core.plugins import Plugins
    from hydra.plugins.search_path_plugin import SearchPathPlugin
    from lightning.pytorch.strategies import StrategyRegistry

    names = [p.__name__ for p in Plugins.instance().discover(SearchPathPlugin)]
    assert "MegaTrainSearchPathPlugin" in names
    assert "megatrain" in StrategyRegistry


def test_compose_groups_through_the_plugin(plugin_configs):
    cfg = compose("train")
    assert cfg.model.model == "llama" and cfg.strategy._target_ == "megatrain_lightning.MegaTrainStrategy"
    assert set(cfg.callbacks) == {"checkpoint", "lr_monitor", "megatrain_monitor"}
    assert set(cfg.logger) == {"csv"}

    cfg = compose(
        "train",
        [
            "strategy=megatrain_nvme",
            "strategy.optimizer_compression=none",
            "strategy.max_vram_gb=2",
            "trainer.max_steps=50",
            "logger=[csv,tensorboard]",
            "callbacks=[checkpoint]",
            "data=file",
            "data.path=/corpus.jsonl",
            "model=hf",
            "model.model=/models/llama",
            "trainer=gpu",
        ],
    )
    s = cfg.strategy
    assert (s.optimizer_compression, s.max_vram_gb, s.activation_checkpointing) == ("none", 2, True)
    offload_dir = OmegaConf.to_container(s)["offload_dir"]  # resolved only inside a Hydra run
    assert offload_dir == "${hydra:runtime.output_dir}/offload"
    assert cfg.trainer.max_steps == 50 and cfg.trainer.precision == "bf16-mixed"
    assert set(cfg.logger) == {"csv", "tensorboard"} and set(cfg.callbacks) == {"checkpoint"}
    assert cfg.data.path == "/corpus.jsonl" and cfg.data.seq_len == 128
    assert cfg.model.model == "/models/llama" and cfg.model.lr == 2e-5

    # Without their folder or file these fail as missing, not as the tiny Llama on the shipped corpus.
    cfg = compose("train", ["model=hf", "data=file"])
    assert OmegaConf.is_missing(cfg.model, "model") and OmegaConf.is_missing(cfg.data, "path")

    cfg = compose("train", ["strategy=plain", "callbacks=none", "logger=none"])
    assert cfg.strategy == "auto" and not cfg.callbacks and not cfg.logger
    for name in ("llama_1b", "llama_7b", "llama_70b", "tiny_gpt2"):
        assert compose("train", [f"model={name}"]).model._target_.endswith("CausalLMModule")


def test_users_app_multirun_finds_configs_via_plugin(tmp_path):
    """A user's own app with no config dir: configs, strategy and callbacks come from the installed package."""
    (tmp_path / "app.py").write_text(USER_APP)
    cmd = [
        sys.executable,
        "app.py",
        "--multirun",
        "model.lr=1e-3,3e-3",
        "strategy.optimizer_compression=none",
        "strategy.max_vram_gb=2",
        "trainer.max_steps=3",
        "callbacks.megatrain_monitor.timeline_step=1",
        "hydra.sweep.dir=sweep",
        *FAST,
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=_env_without_repo(), capture_output=True, text=True, timeout=150
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("final train_loss:") == 2
    for job, lr in (("0", "0.001"), ("1", "0.003")):
        job_dir = tmp_path / "sweep" / job
        assert f"model.lr={lr}" in (job_dir / ".hydra" / "overrides.yaml").read_text()
        run_dir = job_dir / "lightning_logs" / "version_0"
        with open(run_dir / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
        assert sum(1 for r in rows if r.get("tokens_per_s")) == 3  # once per optimizer step
        assert any(r.get("val_ppl") for r in rows)
        assert (run_dir / "timeline_step1.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
        assert (run_dir / "checkpoints" / "last.ckpt").exists()  # a file, or a folder of shards
        assert not (job_dir / "offload").exists()  # the store's folder went with the store


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """``megatrain-train`` with the default configs for 2 steps; its folder."""
    root = tmp_path_factory.mktemp("app")
    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    lightning_log.setLevel(logging.INFO)  # as in a fresh process (the suite's conftest quiets it)
    try:
        with contextlib.chdir(root):
            assert run_command(["megatrain-train", "trainer.max_steps=2", "hydra.run.dir=first", *FAST]) == 0
    finally:
        lightning_log.setLevel(level)
    return root / "first"


def _step_rows(run_dir: Path) -> list[int]:
    with open(run_dir / "lightning_logs" / "version_0" / "metrics.csv") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("train_loss")]


def test_defaults_keep_one_checkpoint_a_log_and_no_empty_folder(first_run):
    checkpoints = first_run / "lightning_logs" / "version_0" / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == ["last.ckpt"]  # one full checkpoint, not two
    log = (first_run / "train.log").read_text()
    assert "final train_loss:" in log and "Trainer.fit" in log  # ours and Lightning's messages
    assert f"{checkpoints / 'last.ckpt'}" in log and " GB" in log  # the checkpoint size line
    assert f"optimizer state are on disk in {first_run / 'offload' / 'megatrain_store'}" in log  # the tier


def test_resume_from_the_apps_checkpoint_with_ckpt_path(first_run, monkeypatch):
    """The documented `ckpt_path` key resumes; so does Trainer.fit(ckpt_path=...) on the same checkpoint."""
    ckpt = first_run / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    monkeypatch.chdir(first_run.parent)
    argv = ["megatrain-train", "trainer.max_steps=4", "hydra.run.dir=second", f"ckpt_path={ckpt}", *FAST]
    assert run_command(argv) == 0
    first, second = _step_rows(first_run), _step_rows(first_run.parent / "second")
    assert len(first) == len(second) == 2 and min(second) > max(first)  # 2 steps restored, 2 more run

    trainer = L.Trainer(
        strategy="megatrain",
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
    )
    trainer.fit(CausalLMModule("llama"), datamodule=TextDataModule(seq_len=32, batch_size=2), ckpt_path=ckpt)
    assert trainer.global_step == 3


def test_offload_folder_is_made_on_first_use_and_never_left_empty(tmp_path, monkeypatch):
    """The strategy's constructor creates nothing; a run refused before its store exists leaves nothing."""
    folder = tmp_path / "run" / "offload"
    MegaTrainStrategy(offload_dir=folder)
    assert not (tmp_path / "run").exists()
    monkeypatch.setattr("megatrain_lightning.store.preflight.free_disk_bytes", lambda path: 10 << 20)
    with pytest.raises(MisconfigurationException, match="GB are free"):
        fit(tiny_model("llama"), MegaTrainStrategy(offload_dir=folder), steps=1)
    assert not (tmp_path / "run").exists()


def test_readme_checkpoint_command_keeps_the_best_checkpoints_too(tmp_path, monkeypatch):
    """The README's and checkpoint.yaml's `save_top_k`/`monitor` overrides exist in the config and work."""
    monkeypatch.chdir(tmp_path)
    argv = ["megatrain-train", "callbacks.checkpoint.save_top_k=3", "callbacks.checkpoint.monitor=val_loss"]
    argv += ["strategy=megatrain", "trainer.max_steps=4", "hydra.run.dir=run", *FAST]
    assert run_command(argv) == 0
    saved = sorted(p.name for p in (tmp_path / "run/lightning_logs/version_0/checkpoints").iterdir())
    assert "last.ckpt" in saved and len(saved) == 3, saved  # validated at steps 2 and 4, both kept


def test_strategy_config_lists_every_option_with_the_strategys_default(plugin_configs):
    """Every MegaTrainStrategy argument can be overridden (`strategy.io_threads=2`), from its own default,
    and the README's "Options" table names each; Lightning's own objects (accelerator, cluster
    environment, precision plugin) come from the Trainer, not the config."""
    from_lightning = {"self", "kwargs", "accelerator", "cluster_environment", "precision_plugin"}
    params = inspect.signature(MegaTrainStrategy.__init__).parameters
    defaults = {name: p.default for name, p in params.items() if name not in from_lightning}
    for group in ("megatrain", "megatrain_nvme"):
        strategy = compose("train", [f"strategy={group}"]).strategy
        assert set(strategy) - {"_target_"} == set(defaults), group
    config = compose("train", ["strategy=megatrain"]).strategy
    assert {
        k: instantiate(v) if k == "timeout" else v for k, v in config.items() if k != "_target_"
    } == defaults
    options = (REPO / "README.md").read_text().split("\n## Options", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `(\w+)`(?:, `(\w+)`)?", options, re.M))
    assert set(defaults) <= {name for pair in named for name in pair}
    compose("train", [f"strategy.{name}=1" for name in ("io_threads", "io_chunk_mb", "optimizer_threads")])
