"""Hugging Face models in and out of the store, and checkpoint directories that resume exactly."""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from contextlib import nullcontext
from typing import Any

import lightning as L
import pytest
import torch
from conftest import (
    UserLM,
    assert_same_training,
    peak_rss_script,
    quiet_trainer,
    tiny_model,
    token_batches,
    user_fit,
)
from transformers import AutoModelForCausalLM

from megatrain_lightning import MegaTrainStrategy, open_checkpoint
from megatrain_lightning.data import TextDataModule
from megatrain_lightning.engine.placeholders import ParamPlaceholder
from megatrain_lightning.interrupts import DeferredInterrupt
from megatrain_lightning.models import CausalLMModule
from megatrain_lightning.presets import tiny_config
from megatrain_lightning.serialization import checkpoint as checkpoint_module
from megatrain_lightning.serialization.checkpoint import optimizer_block
from megatrain_lightning.serialization.checkpoint_dir import CheckpointDir, CheckpointError
from megatrain_lightning.serialization.export import export_hf
from megatrain_lightning.serialization.hf import from_pretrained
from megatrain_lightning.serialization.publish import is_checkpoint_dir
from megatrain_lightning.serialization.safetensors_io import SafetensorsError, ShardWriter, sha256_file
from megatrain_lightning.serialization.single_file import convert_checkpoint


def _trainer(strategy=None, **kwargs) -> L.Trainer:
    defaults = dict(
        strategy=strategy or MegaTrainStrategy(),
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    return L.Trainer(**(defaults | kwargs))


def _logits(trainer: L.Trainer, module: CausalLMModule, ids: torch.Tensor) -> torch.Tensor:
    module.predict_step = lambda batch, batch_idx: module(batch).logits
    return trainer.predict(module, torch.utils.data.DataLoader([ids], batch_size=None))[0]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_sharded_hf_model_streams_into_the_store(tmp_path, arch):
    model = tiny_model(arch)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    module = CausalLMModule(str(tmp_path))
    ids = torch.randint(0, 256, (2, 24))
    logits = _logits(_trainer(), module, ids)
    assert all(isinstance(p, ParamPlaceholder) for p in module.parameters())  # never materialized
    expected = model(input_ids=ids).logits
    assert (logits - expected).abs().max() <= 1e-6


class PretrainedInConfigureModel(UserLM):
    """Loads its model in ``configure_model`` the usual Hugging Face way, then draws a value head."""

    def __init__(self, directory: str) -> None:
        super().__init__(None)
        self.directory = directory

    def configure_model(self) -> None:
        if self.model is None:
            self.model = AutoModelForCausalLM.from_pretrained(self.directory)
            self.value_head = torch.nn.Linear(self.model.config.hidden_size, 1)  # drawn after the load

    def forward(self, batch: dict) -> Any:
        out = self.model(**batch, output_hidden_states=True)
        out.loss = out.loss + self.value_head(out.hidden_states[-1]).square().mean()
        return out


class PretrainedResizedInConfigureModel(PretrainedInConfigureModel):
    """Adds tokens after loading (a tokenizer's new special tokens), new rows drawn around the old mean."""

    def configure_model(self) -> None:
        if self.model is None:
            super().configure_model()
            self.model.resize_token_embeddings(300)


@pytest.mark.parametrize("module_cls", [PretrainedInConfigureModel, PretrainedResizedInConfigureModel])
def test_hugging_faces_from_pretrained_in_configure_model_loads_as_under_the_default_strategy(
    tmp_path, module_cls
):
    tiny_model("llama", seed=5).save_pretrained(tmp_path)
    plain = user_fit(str(tmp_path), "auto", dicts=True, module_cls=module_cls)
    with pytest.warns(
        UserWarning, match="megatrain_lightning.from_pretrained.*streams|straight into the store"
    ):
        paged = user_fit(str(tmp_path), MegaTrainStrategy(), dicts=True, module_cls=module_cls)
    assert_same_training(plain, paged)
    assert all(isinstance(p, ParamPlaceholder) for p in paged.module.parameters())


class StreamedResizedInConfigureModel(PretrainedInConfigureModel):
    def configure_model(self) -> None:
        if self.model is None:
            self.model = from_pretrained(self.directory)
            self.model.resize_token_embeddings(300)
            self.value_head = torch.nn.Linear(self.model.config.hidden_size, 1)


class StreamedUntiedInConfigureModel(PretrainedInConfigureModel):
    def configure_model(self) -> None:
        if self.model is None:
            self.model = from_pretrained(self.directory)
            self.model.config.tie_word_embeddings = False
            head = self.model.model.embed_tokens.weight.detach().clone()
            self.model.lm_head.weight = torch.nn.Parameter(head)
            self.value_head = torch.nn.Linear(self.model.config.hidden_size, 1)


@pytest.mark.parametrize("module_cls", [StreamedResizedInConfigureModel, StreamedUntiedInConfigureModel])
def test_reading_weights_megatrains_streamed_load_fills_later_is_a_clear_error(tmp_path, module_cls):
    """They have no values during the build (a resize's copy of the old rows, a head untied by a copy of the
    embedding would read the recorded random initialization, not the checkpoint's)."""
    tiny_model("llama", tie_word_embeddings=True).save_pretrained(tmp_path)
    with pytest.raises(Exception, match="reads the values of a tensor on the meta device"):
        user_fit(str(tmp_path), MegaTrainStrategy(), module_cls=module_cls)


def test_a_model_built_on_meta_outside_lightning_reads_lazily(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    lazy = from_pretrained(str(tmp_path), lazy=True)
    assert all(p.is_meta for p in lazy.parameters())
    eager = from_pretrained(str(tmp_path), lazy=False)
    assert not any(p.is_meta for p in eager.parameters())


def test_bad_model_directories(tmp_path):
    with pytest.raises(Exception, match="not a Hugging Face model directory"):
        from_pretrained(str(tmp_path))
    model = tiny_model("llama")
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    shards = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    os.rename(tmp_path / shards[0], tmp_path / "moved")
    with pytest.raises(Exception, match="is missing"):
        from_pretrained(str(tmp_path))
    os.rename(tmp_path / "moved", tmp_path / shards[0])
    with open(tmp_path / shards[1], "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / shards[1]) - 100)
    with pytest.raises(SafetensorsError, match="truncated"):
        from_pretrained(str(tmp_path))


def _fit_and_save(tmp_path, strategy=None, steps=4) -> tuple[CausalLMModule, L.Trainer, str]:
    module = CausalLMModule(tiny_model("gpt2"), lr=1e-3, max_steps=10)
    trainer = _trainer(strategy, max_steps=steps, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=TextDataModule(seq_len=32, batch_size=2))
    path = str(tmp_path / "a.ckpt")
    trainer.save_checkpoint(path)
    return module, trainer, path


def test_checkpoint_directory_layout_and_export(tmp_path):
    module, trainer, path = _fit_and_save(tmp_path)
    assert is_checkpoint_dir(path)
    ckpt = CheckpointDir.verify(path)
    assert {"lightning.pt", "model/buffers.safetensors", "model/config.json"} <= set(ckpt.manifest["files"])
    state = torch.load(os.path.join(path, "lightning.pt"), weights_only=True)  # no arbitrary unpickling
    assert state["global_step"] == 4 and "state_dict" not in state
    # Export: a save_pretrained directory whose model computes the trained model's logits.
    export_hf(path, str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 256, (2, 16))
    assert (exported(input_ids=ids).logits - _logits(trainer, module, ids)).abs().max() <= 1e-6


def test_a_checkpoint_directory_loads_with_load_from_checkpoint(tmp_path):
    module, _, path = _fit_and_save(tmp_path, steps=2)
    state_dict = torch.load(open_checkpoint(path), weights_only=True)["state_dict"]
    # The tied head is there under its own name, sharing the embedding's storage as in a plain save.
    head, embedding = state_dict["model.lm_head.weight"], state_dict["model.transformer.wte.weight"]
    assert head.untyped_storage().data_ptr() == embedding.untyped_storage().data_ptr()
    loaded = CausalLMModule.load_from_checkpoint(open_checkpoint(path))  # the model from its saved config
    expected = module.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    assert all(torch.equal(value, expected[name]) for name, value in loaded.state_dict().items())


def test_export_console_command(tmp_path):
    _, _, path = _fit_and_save(tmp_path, steps=1)
    out = subprocess.run(
        [sys.executable, "-m", "megatrain_lightning.cli", "export", path, str(tmp_path / "hf")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "hf" / "config.json").exists()


def test_export_into_a_model_folder_keeps_its_other_files_and_replaces_its_weights(tmp_path):
    module, trainer, path = _fit_and_save(tmp_path, steps=1)
    out = tmp_path / "hf"
    export_hf(path, str(out), max_shard_bytes=100_000)  # several shards and an index
    assert len(list(out.glob("model-*.safetensors"))) > 1
    (out / "tokenizer.json").write_text("{}")
    (out / "extras").mkdir()
    (out / "extras" / "card.md").write_text("mine")
    export_hf(path, str(out))  # one file now: no shard of the first export stays
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "extras",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert (out / "extras" / "card.md").read_text() == "mine"
    ids = torch.randint(0, 256, (2, 16))
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert (exported(input_ids=ids).logits - _logits(trainer, module, ids)).abs().max() <= 1e-6
    assert not list(tmp_path.glob("*.tmp-*"))


@pytest.mark.parametrize("target", ["a file", "a checkpoint", "the current folder", "inside the checkpoint"])
def test_export_refuses_what_it_would_destroy_and_writes_nothing(tmp_path, monkeypatch, target):
    _, _, path = _fit_and_save(tmp_path, steps=1)
    (tmp_path / "file").write_text("mine")
    out = {
        "a file": tmp_path / "file",
        "a checkpoint": tmp_path / "a.ckpt",
        "the current folder": tmp_path,
        "inside the checkpoint": tmp_path / "a.ckpt" / "hf",
    }[target]
    monkeypatch.chdir(tmp_path)
    path = os.path.relpath(path) if target == "a checkpoint" else path  # the same folder, named otherwise
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(FileExistsError, match="nothing was written"):
        export_hf(path, str(out))
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "file").read_text() == "mine"


def test_saving_over_a_checkpoint_file_replaces_it_and_leaves_nothing_else(tmp_path):
    (tmp_path / "a.ckpt").write_bytes(b"a checkpoint of the default strategy")
    _fit_and_save(tmp_path, steps=1)
    assert is_checkpoint_dir(tmp_path / "a.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir() if "a.ckpt" in p.name) == ["a.ckpt"]


def test_long_checkpoint_work_shows_a_progress_bar(tmp_path, monkeypatch, capsys):
    """Loading weights, saving, checking, exporting and converting show tqdm bars with the rate, for work large enough to
    wait for (here the threshold is lowered to a tiny model's bytes; at the default, the tiny model's
    saves show none)."""
    _fit_and_save(tmp_path / "quiet", steps=1)
    assert "B/s" not in capsys.readouterr().err
    monkeypatch.setattr("megatrain_lightning.telemetry.progress.SHOWN_FROM_BYTES", 1)
    _, _, path = _fit_and_save(tmp_path, steps=1)
    export_hf(path, str(tmp_path / "hf"))
    convert_checkpoint(path, str(tmp_path / "one.ckpt"))
    err = capsys.readouterr().err
    works = ("loading weights into the store", "saving a.ckpt", f"checking {path}", "exporting hf")
    for work in (*works, f"writing {tmp_path / 'one.ckpt'}"):
        assert work in err, work
        last = err.rsplit(work, 1)[1].split("\n", 1)[0]  # the bar as it closed
        assert "100%" in last and "B/s" in last, (work, last)


def test_corrupt_or_foreign_checkpoints_are_refused_before_loading(tmp_path):
    _, _, path = _fit_and_save(tmp_path, steps=1)
    shard = os.path.join(path, "model", "block-00001.safetensors")
    with open(shard, "r+b") as f:  # flip one byte of the weights
        f.seek(-10, os.SEEK_END)
        byte = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    module = CausalLMModule(tiny_model("gpt2"), lr=1e-3)
    with pytest.raises(CheckpointError, match="checksum"):
        _trainer(max_steps=2, default_root_dir=tmp_path).fit(
            module, datamodule=TextDataModule(seq_len=32, batch_size=2), ckpt_path=path
        )
    _, _, path = _fit_and_save(tmp_path / "b", steps=1)
    os.truncate(shard.replace(str(tmp_path), str(tmp_path / "b")), 100)
    with pytest.raises(CheckpointError, match="truncated"):
        CheckpointDir.verify(path)
    _, _, path = _fit_and_save(tmp_path / "c", steps=1)
    other = CausalLMModule(tiny_model("gpt2", n_layer=3), lr=1e-3)
    with pytest.raises(CheckpointError, match="other parameters or shapes"):
        _trainer(max_steps=2, default_root_dir=tmp_path).fit(
            other, datamodule=TextDataModule(seq_len=32, batch_size=2), ckpt_path=path
        )


def test_the_folder_of_the_checkpoints_given_instead_of_one_names_them(tmp_path):
    _fit_and_save(tmp_path, steps=1)
    with pytest.raises(CheckpointError, match=f"holds 1 checkpoint.*e.g. {tmp_path / 'a.ckpt'}"):
        CheckpointDir.verify(tmp_path)


def test_loading_never_unpickles_code(tmp_path):
    _, _, path = _fit_and_save(tmp_path, steps=1)

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    target = os.path.join(path, "lightning.pt")
    with open(target, "wb") as f:
        pickle.dump({"global_step": Evil()}, f)
    manifest_path = tmp_path / "a.ckpt" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["lightning.pt"] = {"bytes": os.path.getsize(target), "sha256": sha256_file(target)}
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(Exception, match="(?i)weights.only|unpickl"):
        CheckpointDir.verify(path).lightning_state()
    assert not (tmp_path / "pwned").exists()


RESUME_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys
    import lightning as L, torch
    sys.path.insert(0, sys.argv[5])
    from conftest import tiny_model
    from megatrain_lightning import MegaTrainStrategy
    from megatrain_lightning.data import TextDataModule
    from megatrain_lightning.models import CausalLMModule

    mode, root, tier, compression = sys.argv[1:5]

    class Record(L.Callback):
        def __init__(self):
            self.losses = {}
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if mode == "killed" and trainer.global_step == 7:
                os.kill(os.getpid(), signal.SIGKILL)
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.losses[trainer.global_step] = float(outputs["loss"])

    kwargs = {"optimizer_compression": compression}
    if tier == "disk":
        kwargs |= {"offload_dir": os.path.join(root, "offload-" + mode), "max_cpu_gb": 0.003}
    record = Record()
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=os.path.join(root, "ckpt-" + mode), every_n_train_steps=5, save_top_k=-1)
    trainer = L.Trainer(strategy=MegaTrainStrategy(**kwargs), accelerator="cpu", max_steps=10,
                        limit_train_batches=5, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[record, checkpoints])
    module = CausalLMModule(tiny_model("llama", num_hidden_layers=8), lr=3e-3, max_steps=10)
    resume = os.path.join(root, "ckpt-killed", "epoch=0-step=5.ckpt") if mode == "resumed" else None
    torch.manual_seed(0)
    trainer.fit(module, datamodule=TextDataModule(seq_len=32, batch_size=2), ckpt_path=resume)
    weights = {k: v.tolist() for k, v in module.state_dict().items()}
    print(json.dumps({"losses": record.losses, "weights": weights}))
    """
)


def _run(mode: str, root, tier: str, compression: str) -> subprocess.CompletedProcess:
    tests = os.path.dirname(__file__)
    return subprocess.run(
        [sys.executable, "-c", RESUME_SCRIPT, mode, str(root), tier, compression, tests],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("compression", ["none", "int4"])
def test_resume_after_sigkill_equals_the_uninterrupted_run(tmp_path, tier, compression):
    full = _run("full", tmp_path, tier, compression)
    assert full.returncode == 0, full.stderr[-3000:]
    killed = _run("killed", tmp_path, tier, compression)
    assert killed.returncode == -signal.SIGKILL
    assert is_checkpoint_dir(tmp_path / "ckpt-killed" / "epoch=0-step=5.ckpt")
    resumed = _run("resumed", tmp_path, tier, compression)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = json.loads(full.stdout.strip().splitlines()[-1])
    got = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert sorted(got["losses"], key=int) == [str(s) for s in range(6, 11)]  # steps 6-10
    for step, loss in got["losses"].items():
        assert loss == expected["losses"][step], f"step {step}"
    assert got["weights"] == expected["weights"]


SAVE_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import lightning as L
    sys.path.insert(0, sys.argv[2])
    from conftest import tiny_model
    from megatrain_lightning import MegaTrainStrategy
    from megatrain_lightning.serialization import safetensors_io
    from megatrain_lightning.data import TextDataModule
    from megatrain_lightning.models import CausalLMModule

    root = sys.argv[1]
    trainer = L.Trainer(strategy=MegaTrainStrategy(), accelerator="cpu", max_steps=2, logger=False,
                        enable_progress_bar=False, limit_val_batches=0, enable_checkpointing=False,
                        enable_model_summary=False)
    module = CausalLMModule(tiny_model("llama"), lr=1e-3)
    trainer.fit(module, datamodule=TextDataModule(seq_len=32, batch_size=2))
    trainer.save_checkpoint(os.path.join(root, "good.ckpt"))
    append = safetensors_io.ShardWriter.append  # every byte of a checkpoint's tensors goes through it
    def slow_append(self, data):
        time.sleep(0.2)
        append(self, data)
    safetensors_io.ShardWriter.append = slow_append
    print("saving", flush=True)
    trainer.save_checkpoint(os.path.join(root, "next.ckpt"))
    trainer.save_checkpoint(os.path.join(root, "good.ckpt"))
    """
)


def test_sigkill_while_saving_leaves_the_previous_checkpoint_loadable(tmp_path):
    tests = os.path.dirname(__file__)
    proc = subprocess.Popen(
        [sys.executable, "-c", SAVE_SCRIPT, str(tmp_path), tests], stdout=subprocess.PIPE, text=True
    )
    while (line := proc.stdout.readline()) and line.strip() != "saving":
        pass
    deadline = time.time() + 60
    while not any(".tmp-" in name for name in os.listdir(tmp_path)) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not is_checkpoint_dir(tmp_path / "next.ckpt")
    assert not os.path.exists(tmp_path / "next.ckpt")  # only the temporary directory exists
    CheckpointDir.verify(tmp_path / "good.ckpt")
    module = CausalLMModule(tiny_model("llama"), lr=1e-3)
    trainer = _trainer(max_steps=3, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=TextDataModule(seq_len=32, batch_size=2), ckpt_path=tmp_path / "good.ckpt")
    assert trainer.global_step == 3


LOAD_SCRIPT = peak_rss_script(
    """
    import json, sys, threading, time
    import lightning as L, psutil, torch
    from megatrain_lightning import MegaTrainStrategy
    from megatrain_lightning.data import TextDataModule
    from megatrain_lightning.models import CausalLMModule

    model_dir, offload = sys.argv[1], sys.argv[2]
    PEAK_RSS_WATCHER
    module = CausalLMModule(model_dir)
    strategy = MegaTrainStrategy(offload_dir=offload, max_cpu_gb=0.2, max_vram_gb=0.03)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", logger=False, enable_progress_bar=False,
                        limit_val_batches=1, enable_model_summary=False)
    loss = trainer.validate(module, datamodule=TextDataModule(seq_len=16, batch_size=1), verbose=False)[0]
    time.sleep(0.05)
    print(json.dumps({"baseline": baseline, "peak": peak["rss"], "val_loss": loss["val_loss"]}))
    """
)


def test_a_gigabyte_model_loads_in_a_fraction_of_its_size(tmp_path):
    config = tiny_config(
        "llama",
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=80,
        num_attention_heads=8,
        num_key_value_heads=8,
    )
    model = AutoModelForCausalLM.from_config(config)
    model_bytes = 4 * sum(p.numel() for p in model.parameters())
    assert model_bytes >= 1e9
    model.save_pretrained(tmp_path / "model", max_shard_size="300MB")
    del model
    out = subprocess.run(
        [sys.executable, "-c", LOAD_SCRIPT, str(tmp_path / "model"), str(tmp_path / "offload")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0 < figures["val_loss"] < 10
    # Bound: the RSS the load adds stays below half the model's fp32 size (the cache is 0.2 GB).
    assert figures["peak"] - figures["baseline"] < model_bytes / 2, figures


@pytest.mark.parametrize("compression", ["none", "int4"])
def test_a_save_holds_one_store_chunk_of_a_block_at_a_time(tmp_path, monkeypatch, compression):
    """A 7B layer is 0.8 GB in fp32: the checkpoint streams it a chunk at a time (a whole-block read pushed
    the 7B run's RSS past 8 GiB while saving); the files read back as the weights and state trained."""
    chunk_mb = 1 / 64
    strategy = MegaTrainStrategy(
        offload_dir=tmp_path / "store", io_chunk_mb=chunk_mb, optimizer_compression=compression
    )
    run = user_fit(tiny_model("llama", hidden_size=64, intermediate_size=172), strategy, steps=2)
    engine = strategy.engine
    assert max(b.numel for b in engine.blocks) > 4 * strategy.io.chunk_numel
    pieces: list[int] = []
    append = ShardWriter.append
    monkeypatch.setattr(
        ShardWriter, "append", lambda self, data: (pieces.append(data.nbytes), append(self, data))[1]
    )
    run.trainer.save_checkpoint(tmp_path / "saved.ckpt")
    assert pieces and max(pieces) <= strategy.io.chunk_bytes
    ckpt = CheckpointDir.verify(tmp_path / "saved.ckpt")
    saved = torch.load(open_checkpoint(tmp_path / "saved.ckpt"), weights_only=True)["state_dict"]
    for name, value in run.module.state_dict().items():
        assert torch.equal(saved[name], value), name
    optimizer, entries = engine.optimizer, ckpt.optimizer().entries
    for block in engine.blocks:
        state = optimizer_block(entries, block.index)
        for kind in optimizer.state_kinds:
            assert torch.equal(state[kind], optimizer.store.read(block.index, kind)), (block.index, kind)
        assert state["step"].tolist() == optimizer.steps[block.index]


class StoppedInBackward(Exception):
    """Stands in for Ctrl-C or an out-of-memory error during a step's backward."""


class InTheThirdBackward(UserLM):
    """Calls ``in_backward`` during the third step's backward, between the first decoder layer and the
    embedding: the later blocks' updates have begun by then (plain Lightning updates nothing before the
    backward ends)."""

    def in_backward(self) -> None:
        raise NotImplementedError

    def training_step(self, batch, batch_idx):
        if self.global_step != 2:
            return super().training_step(batch, batch_idx)

        def hook_the_input(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            hidden.register_hook(lambda grad: self.in_backward())

        handle = self.model.model.layers[0].register_forward_pre_hook(hook_the_input, with_kwargs=True)
        try:
            return super().training_step(batch, batch_idx)
        finally:
            handle.remove()


class StopsInTheThirdBackward(InTheThirdBackward):
    def in_backward(self) -> None:
        raise StoppedInBackward()


@pytest.mark.parametrize("deferred", [False, True], ids=["updates-in-backward", "clipped"])
def test_no_checkpoint_holds_a_step_cut_short_by_an_exception_in_its_backward(tmp_path, deferred):
    """Some blocks were updated when the backward stopped: `OnExceptionCheckpoint` writes nothing (warned)
    and a save of the user's is an error, where such a checkpoint would resume to other weights. With
    updates deferred to the backward's end (clipping) nothing was updated: written, as plain's."""
    clip = {"gradient_clip_val": 1.0} if deferred else {}
    saved = L.pytorch.callbacks.OnExceptionCheckpoint(tmp_path)
    module = StopsInTheThirdBackward(tiny_model("llama"))
    trainer = quiet_trainer(
        MegaTrainStrategy(), 6, [saved], enable_checkpointing=True, default_root_dir=tmp_path, **clip
    )
    batches = torch.utils.data.DataLoader(token_batches(6), batch_size=None)
    warned = pytest.warns(UserWarning, match="between two steps") if not deferred else nullcontext()
    with warned, pytest.raises(StoppedInBackward):
        trainer.fit(module, train_dataloaders=batches)
    assert os.path.exists(saved.ckpt_path) == deferred
    if not deferred:
        with pytest.raises(RuntimeError, match="after [1-9] of 5 blocks were updated"):
            trainer.save_checkpoint(tmp_path / "mine.ckpt")
        assert not os.path.exists(tmp_path / "mine.ckpt")


@pytest.mark.parametrize("resume", [False, True], ids=["trains-on", "resumes"])
def test_a_fit_after_a_step_cut_short_says_it_trains_on_from_weights_between_two_steps(tmp_path, resume):
    """The module keeps the weights a stopped backward left between two steps: a later fit says it trains on
    from them; one resumed from the checkpoint before loads whole steps and says nothing."""
    saved = L.pytorch.callbacks.ModelCheckpoint(tmp_path, "{step}", every_n_train_steps=1, save_top_k=-1)
    module = StopsInTheThirdBackward(tiny_model("llama"))
    batches = torch.utils.data.DataLoader(token_batches(6), batch_size=None)
    trainer = quiet_trainer(MegaTrainStrategy(), 6, [saved], enable_checkpointing=True)
    with pytest.raises(StoppedInBackward):
        trainer.fit(module, train_dataloaders=batches)
    later = UserLM(module.model)
    ckpt_path = tmp_path / "step=2.ckpt" if resume else None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_trainer(MegaTrainStrategy(), 3, []).fit(later, train_dataloaders=batches, ckpt_path=ckpt_path)
    said = [w for w in seen if "trains on from them" in str(w.message)]
    assert len(said) == (0 if resume else 1)


class CtrlCInTheThirdBackward(InTheThirdBackward):
    """Ctrl-C is pressed ``presses`` times during the third step's backward."""

    def __init__(self, model: torch.nn.Module, presses: int) -> None:
        super().__init__(model)
        self.presses = presses

    def in_backward(self) -> None:
        for _ in range(self.presses):
            signal.raise_signal(signal.SIGINT)


@pytest.fixture
def ctrl_c_restored():
    yield
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning ignores it after a KeyboardInterrupt


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_in_a_backward_finishes_the_step_and_a_second_one_stops_at_once(
    tmp_path, presses, ctrl_c_restored, caplog, monkeypatch
):
    """Ctrl-C during a step's backward, once blocks were updated: the step finishes, the run stops before the
    next, so `OnExceptionCheckpoint` holds three whole steps and the run resumed from it trains as the
    uninterrupted one. Pressed twice, the run stops at once and no checkpoint holds the step cut short."""
    batches = token_batches(3)  # an epoch is three steps: the run resumes at the next epoch's first batch
    saved = L.pytorch.callbacks.OnExceptionCheckpoint(tmp_path)
    module = CtrlCInTheThirdBackward(tiny_model("llama"), presses)
    trainer = quiet_trainer(
        MegaTrainStrategy(), 6, [saved], enable_checkpointing=True, default_root_dir=tmp_path
    )
    cut_short = pytest.warns(UserWarning, match="between two steps") if presses == 2 else nullcontext()
    lightning_log = logging.getLogger("lightning.pytorch")  # Lightning's messages stop there
    monkeypatch.setattr(lightning_log, "handlers", [*lightning_log.handlers, caplog.handler])
    caplog.set_level("INFO", logger="lightning.pytorch")
    with cut_short, pytest.raises(SystemExit):  # Lightning's exit on Ctrl-C
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    assert "Ctrl-C: finishing this step first" in caplog.text
    if presses == 2:
        assert not os.path.exists(saved.ckpt_path)
        return
    assert torch.load(open_checkpoint(saved.ckpt_path), weights_only=True)["global_step"] == 3
    resumed = UserLM(tiny_model("llama", seed=1))
    trainer = quiet_trainer(MegaTrainStrategy(), 6, [])
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    trainer.fit(resumed, train_dataloaders=loader, ckpt_path=saved.ckpt_path)
    uninterrupted = user_fit(tiny_model("llama"), "auto", 6, batches=batches)
    for name, weight in uninterrupted.state_dict().items():
        assert torch.equal(weight, resumed.state_dict()[name]), name


def test_a_ctrl_c_noted_in_a_step_that_then_fails_is_not_left_pending(ctrl_c_restored):
    interrupt = DeferredInterrupt()
    with pytest.raises(RuntimeError, match="the step failed"), interrupt.finishing_the_step():
        signal.raise_signal(signal.SIGINT)
        assert interrupt.pending
        raise RuntimeError("the step failed")
    assert not interrupt.pending  # the run ended with the failure: nothing is raised later
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_during_a_checkpoint_write_leaves_no_partial_copy(tmp_path, monkeypatch):
    run = user_fit(tiny_model("llama"), MegaTrainStrategy(), 1)

    def ctrl_c(*args: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_module, "write_rest", ctrl_c)  # after every block's files were written
    with pytest.raises(KeyboardInterrupt):
        run.trainer.save_checkpoint(tmp_path / "mine.ckpt")
    assert os.listdir(tmp_path) == []
