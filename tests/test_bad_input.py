"""Every rejected input of README's "Rejected inputs" table: the error says what to change, and nothing was
written (every file under the test's folder, the checkpoints and model directories included, is as it was,
and no file or folder appeared)."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning
import pytest
import torch
from conftest import UserLM, quiet_trainer, tiny_model, token_batches
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging
from torch import nn

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.models import CausalLMModule
from megatrain_lightning.serialization.export import export_hf
from megatrain_lightning.serialization.publish import CheckpointIOError
from megatrain_lightning.serialization.safetensors_io import SafetensorsError
from megatrain_lightning.store.disk import DiskStore
from megatrain_lightning.store.io import StoreIOError

README = Path(__file__).resolve().parents[1] / "README.md"


@dataclass(frozen=True)
class Case:
    id: str
    match: str  # a fragment of the message (a regular expression)
    prepare: Callable[[Path, dict[str, Any]], Callable[[], Any]]  # sets up; returns the call that must fail
    error: type[BaseException] = MisconfigurationException


def _fit(
    tmp: Path, strategy: Any = None, module: Any = None, ckpt_path: Any = None, callbacks=(), **trainer_kwargs
) -> None:
    module = module or UserLM(tiny_model("llama"))
    strategy = strategy or MegaTrainStrategy()
    trainer = quiet_trainer(strategy, 1, list(callbacks), default_root_dir=tmp / "run", **trainer_kwargs)
    loader = torch.utils.data.DataLoader(token_batches(1), batch_size=None)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)


def _with(optimizer: Callable[[nn.Module], Any]) -> UserLM:
    module = UserLM(tiny_model("llama"))
    module.configure_optimizers = lambda: optimizer(module)
    return module


def _two() -> UserLM:
    module = _with(lambda m: [torch.optim.AdamW(m.parameters()), torch.optim.AdamW(m.parameters())])
    module.automatic_optimization = False
    return module


def _hf_checkpointing() -> UserLM:
    model = tiny_model("llama")
    model.gradient_checkpointing_enable()
    return UserLM(model)


class _UploadingIO(TorchCheckpointIO):
    """A user's checkpoint IO plugin (one that would upload each checkpoint)."""


class _NoRepeatedLayers(UserLM):
    def __init__(self) -> None:
        super().__init__(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))

    def training_step(self, batch, batch_idx):
        return self.model(torch.ones(2, 4)).sum()


def _checkpoint(tmp: Path, fixtures: dict[str, Any], change: Callable[[Path], None] = lambda p: None) -> Path:
    path = tmp / "saved.ckpt"
    shutil.copytree(fixtures["checkpoint"], path)
    change(path)
    return path


def _save_over(tmp: Path, target: Path) -> Callable[[], None]:
    """Train a step, then save to ``target`` (a user's folder: it must be left as it was)."""
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    trainer = quiet_trainer(MegaTrainStrategy(), 1, [], default_root_dir=tmp / "run")
    loader = torch.utils.data.DataLoader(token_batches(1), batch_size=None)
    trainer.fit(UserLM(tiny_model("llama")), train_dataloaders=loader)
    return lambda: trainer.save_checkpoint(target)


def _export(checkpoint: Path, out: Path) -> Callable[[], None]:
    return lambda: export_hf(str(checkpoint), str(out))


def _compiled() -> UserLM:
    module = UserLM(tiny_model("llama"))
    module.model = torch.compile(module.model)
    return module


def _resume(tmp: Path, path: Path, module: Any = None) -> Callable[[], None]:
    return lambda: _fit(tmp, module=module, ckpt_path=path)


def _load(tmp: Path, hf_dir: Path) -> Callable[[], None]:
    """Train a model read from ``hf_dir`` (built on meta, its store filled from the shards)."""
    return lambda: _fit(tmp, module=CausalLMModule(str(hf_dir)))


def _junk(path: Path) -> Path:
    path.write_bytes(b"garbage\n")
    return path


def _flip_a_byte(path: Path) -> None:
    with open(path / "model" / "block-00001.safetensors", "r+b") as f:
        f.seek(-10, os.SEEK_END)
        byte = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


def _foreign_manifest(path: Path) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps(manifest | {"format": "something-else"}))


def _hf_dir(tmp: Path, fixtures: dict[str, Any], change: Callable[[Path], None]) -> Path:
    path = tmp / "hf_model"
    shutil.copytree(fixtures["hf_dir"], path)
    change(path)
    return path


def _shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def _truncate(file: Path) -> None:
    os.truncate(file, os.path.getsize(file) - 100)


def _hold_store(tmp: Path, fixtures: dict[str, Any]) -> Callable[[], Any]:
    from megatrain_lightning.engine.blocks import discover_blocks

    held = DiskStore(discover_blocks(tiny_model("llama")), str(tmp / "offload"), 1 << 24, kinds=["param"])
    fixtures["held"] = held  # closed by the fixture's teardown
    return lambda: _fit(tmp, MegaTrainStrategy(offload_dir=tmp / "offload"))


def _mock(fixtures: dict[str, Any], target: str, value: Any) -> None:
    fixtures["monkeypatch"].setattr(target, value)


CASES = [
    # budgets
    Case("max_vram_gb=-1", "positive number", lambda t, f: lambda: MegaTrainStrategy(max_vram_gb=-1)),
    Case("max_cpu_gb='8GB'", "positive number", lambda t, f: lambda: MegaTrainStrategy(max_cpu_gb="8GB")),
    Case(
        "max_vram_gb below the largest block",
        "smaller than the largest block",
        lambda t, f: lambda: _fit(t, MegaTrainStrategy(max_vram_gb=1e-6)),
    ),
    Case(
        "max_cpu_gb below the store chunks in use at once",
        "cannot hold the store chunks in use at once",
        lambda t, f: lambda: _fit(t, MegaTrainStrategy(offload_dir=t / "offload", max_cpu_gb=1e-6)),
    ),
    Case(
        "max_cpu_gb above the available RAM",
        "RAM available",
        lambda t, f: (
            _mock(f, "megatrain_lightning.store.preflight.available_ram_bytes", lambda: 1 << 30),
            lambda: MegaTrainStrategy(max_cpu_gb=2),
        )[1],
    ),
    # offload folder
    Case(
        "offload_dir is a file",
        "exists and is not a directory",
        lambda t, f: (t.joinpath("file").write_text("x"), lambda: MegaTrainStrategy(offload_dir=t / "file"))[
            1
        ],
    ),
    Case(
        "offload_dir cannot be created",
        "not a writable directory",
        lambda t, f: (
            t.joinpath("file").write_text("x"),
            lambda: MegaTrainStrategy(offload_dir=t / "file" / "sub"),
        )[1],
    ),
    Case("offload_dir=123", "must be a path", lambda t, f: lambda: MegaTrainStrategy(offload_dir=123)),
    Case(
        "offload_dir on a disk without room for the store",
        "GB are free",
        lambda t, f: (
            _mock(f, "megatrain_lightning.store.preflight.free_disk_bytes", lambda path: 10 << 20),
            lambda: _fit(t, MegaTrainStrategy(offload_dir=t / "offload")),
        )[1],
    ),
    Case(
        "a checkpoint folder on a disk without room for the checkpoint",
        "GB are free on its disk",
        lambda t, f: (
            _mock(f, "megatrain_lightning.serialization.checkpoint.free_disk_bytes", lambda path: 10 << 20),
            _checkpoint(t, f),  # the previous checkpoint, which must stay as it is
            lambda: _fit(
                t, callbacks=[ModelCheckpoint(dirpath=t, filename="saved")], enable_checkpointing=True
            ),
        )[2],
        CheckpointIOError,
    ),
    Case("offload_dir in use by another model or run", "is in use by", _hold_store, StoreIOError),
    # options
    Case(
        "optimizer_compression='int1'",
        "`optimizer_compression` must be one of",
        lambda t, f: lambda: MegaTrainStrategy(optimizer_compression="int1"),
    ),
    Case(
        "prefetch_depth=-1",
        "`prefetch_depth` must be",
        lambda t, f: lambda: MegaTrainStrategy(prefetch_depth=-1),
    ),
    Case(
        "io_threads=0",
        "`io_threads` must be an int >= 1",
        lambda t, f: lambda: MegaTrainStrategy(io_threads=0),
    ),
    Case(
        "max_vram=2 (a misspelt option)",
        "has no option `max_vram`. Did you mean `max_vram_gb`?",
        lambda t, f: lambda: MegaTrainStrategy(max_vram=2),
    ),
    Case(
        "a model without repeated layers",
        "block_classes",
        lambda t, f: lambda: _fit(t, module=_NoRepeatedLayers()),
    ),
    # optimizer
    Case(
        "torch.optim.SGD",
        "supports `torch.optim.AdamW` and `torch.optim.Adam`",
        lambda t, f: lambda: _fit(t, module=_with(lambda m: torch.optim.SGD(m.parameters(), lr=0.1))),
    ),
    Case(
        "AdamW(amsgrad=True)",
        "does not support `amsgrad=True`",
        lambda t, f: lambda: _fit(t, module=_with(lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True))),
    ),
    Case(
        "AdamW(capturable=True)",
        "does not support `capturable=True` (the update runs on the CPU, outside CUDA graphs)",
        lambda t, f: (
            lambda: _fit(t, module=_with(lambda m: torch.optim.AdamW(m.parameters(), capturable=True)))
        ),
    ),
    Case(
        "Adam(differentiable=True)",
        "does not support `differentiable=True`",
        lambda t, f: (
            lambda: _fit(t, module=_with(lambda m: torch.optim.Adam(m.parameters(), differentiable=True)))
        ),
    ),
    Case(
        "two optimizers (manual optimization)",
        "supports one optimizer; `configure_optimizers` returned 2. Return one AdamW with a param group for each",
        lambda t, f: lambda: _fit(t, module=_two()),
    ),
    Case(
        "StochasticWeightAveraging",
        "does not support `StochasticWeightAveraging`",
        lambda t, f: lambda: _fit(t, callbacks=[StochasticWeightAveraging(swa_lrs=1e-2)]),
    ),
    Case(
        "a CheckpointIO plugin of one's own",
        "plugin would never be called",
        lambda t, f: lambda: _fit(t, plugins=[_UploadingIO()]),
    ),
    Case(
        "gradient_checkpointing_enable() with activation_checkpointing=False",
        "keeps every block's activations instead",
        lambda t, f: (
            lambda: _fit(t, MegaTrainStrategy(activation_checkpointing=False), module=_hf_checkpointing())
        ),
    ),
    Case(
        "a torch.compile'd model",
        "cannot page a `torch.compile`d module",
        lambda t, f: lambda: _fit(t, module=_compiled()),
    ),
    # devices and precision
    Case(
        "precision='64-true'",
        "megatrain supports precision",
        lambda t, f: lambda: _fit(t, precision="64-true"),
    ),
    Case(
        "Fabric(strategy='megatrain')",
        "a strategy of Lightning's `Trainer`",
        lambda t, f: lambda: lightning.Fabric(strategy="megatrain", accelerator="cpu"),
    ),
    # checkpoints
    Case(
        "save_checkpoint to a folder that is not a checkpoint",
        "is a folder that is not a megatrain checkpoint",
        lambda t, f: _save_over(t, t / "mydata"),
        CheckpointIOError,
    ),
    Case(
        "megatrain export into the checkpoint (or a folder holding it)",
        "is the checkpoint, or holds it or lies inside it",
        lambda t, f: _export(_checkpoint(t, f), t),
        FileExistsError,
    ),
    Case(
        "trainer.fit(ckpt_path=...) that does not exist",
        "does not exist",
        lambda t, f: _resume(t, t / "run" / "checkpoints" / "last.ckpt"),
        FileNotFoundError,
    ),
    Case(
        "a corrupt checkpoint (one byte changed)",
        "does not match its checksum",
        lambda t, f: _resume(t, _checkpoint(t, f, _flip_a_byte)),
    ),
    Case(
        "a file that is not a checkpoint",
        "cannot be read as a checkpoint without running code from it",
        lambda t, f: _resume(t, _junk(t / "junk.ckpt")),
    ),
    Case(
        "a truncated checkpoint",
        "is missing or truncated",
        lambda t, f: _resume(
            t, _checkpoint(t, f, lambda p: _truncate(p / "model" / "block-00001.safetensors"))
        ),
    ),
    Case(
        "an incomplete checkpoint (no manifest.json)",
        "not a complete megatrain checkpoint",
        lambda t, f: _resume(t, _checkpoint(t, f, lambda p: os.remove(p / "manifest.json"))),
    ),
    Case(
        "a foreign directory with a manifest.json",
        "does not describe a megatrain checkpoint",
        lambda t, f: _resume(t, _checkpoint(t, f, _foreign_manifest)),
    ),
    Case(
        "a checkpoint of a different model",
        "other parameters or shapes",
        lambda t, f: _resume(t, _checkpoint(t, f), UserLM(tiny_model("llama", num_hidden_layers=3))),
    ),
    # Hugging Face model directories
    Case(
        "a HF directory without config.json",
        "nor a directory holding a Hugging Face config.json",
        lambda t, f: _load(t, _hf_dir(t, f, lambda p: os.remove(p / "config.json"))),
        ValueError,
    ),
    Case(
        "a HF directory that does not exist",
        "no such directory (nothing is downloaded",
        lambda t, f: _load(t, t / "no_such_model"),
        ValueError,
    ),
    Case(
        "a HF directory with a shard missing",
        "is missing",
        lambda t, f: _load(t, _hf_dir(t, f, lambda p: os.remove(_shards(p)[0]))),
    ),
    Case(
        "a HF directory with a truncated shard",
        "truncated",
        lambda t, f: _load(t, _hf_dir(t, f, lambda p: _truncate(_shards(p)[1]))),
        SafetensorsError,
    ),
    Case(
        "a HF directory without safetensors weights",
        "holds no safetensors weights",
        lambda t, f: _load(t, _hf_dir(t, f, lambda p: [os.remove(s) for s in p.glob("*.safetensors*")])),
    ),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A megatrain checkpoint of the tiny Llama and a sharded HF directory of it, copied by each case."""
    root = tmp_path_factory.mktemp("saved")
    module = UserLM(tiny_model("llama"))
    trainer = quiet_trainer(MegaTrainStrategy(), 1, [])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(token_batches(1), batch_size=None))
    trainer.save_checkpoint(root / "a.ckpt")
    copy.deepcopy(tiny_model("llama")).save_pretrained(root / "hf", max_shard_size="100KB")
    return {"checkpoint": root / "a.ckpt", "hf_dir": root / "hf"}


def _snapshot(root: Path) -> dict[str, tuple[int, int] | None]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else None
        for p in root.rglob("*")
    }


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_a_rejected_input_says_what_to_change_and_writes_nothing(case, saved, tmp_path, monkeypatch):
    fixtures = dict(saved, monkeypatch=monkeypatch)
    try:
        call = case.prepare(tmp_path, fixtures)
        before = _snapshot(tmp_path)
        with pytest.raises(case.error, match=re.escape(case.match)):
            call()
        assert _snapshot(tmp_path) == before, "a rejected input left something written"
    finally:
        if "held" in fixtures:
            fixtures["held"].close()


def test_the_readme_lists_every_rejected_input():
    section = README.read_text().split("## Rejected inputs", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    for case in CASES:
        assert any(case.id in row and case.match in row for row in rows), (
            f"README lacks a row for {case.id!r}"
        )
