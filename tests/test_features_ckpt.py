"""Checkpoints and the Lightning features around them, each compared with the default strategy: a megatrain
checkpoint read as a standard one, resuming across strategies, ``load_state_dict`` after setup, the disk
tier's state dict, the checkpoint hooks and IO plugins, ModelCheckpoint + EarlyStopping +
``ckpt_path="last"``, validate/test/predict after fit."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import LossRecorder, Run, UserLM, assert_same_training, quiet_trainer, tiny_model, token_batches
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

import megatrain_lightning
from megatrain_lightning import MegaTrainStrategy, convert_checkpoint, open_checkpoint
from megatrain_lightning.cli import main as cli_main
from megatrain_lightning.optim import codecs
from megatrain_lightning.serialization.checkpoint_dir import CheckpointError
from megatrain_lightning.serialization.publish import is_checkpoint_dir

TRAIN = token_batches(3)  # one epoch: three optimizer steps
VAL = token_batches(2, seed=1)
STRATEGIES = ("auto", "megatrain")


class ScheduledLM(UserLM):
    """``UserLM`` with two param groups (no weight decay on vectors) and a per-step ``StepLR``: the optimizer
    numbers its parameters unlike the module, and the scheduler has state to resume."""

    def configure_optimizers(self) -> Any:
        params = list(self.parameters())
        groups = [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _loader(batches: list[Any]) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(batches, batch_size=None)


def _trainer(strategy: Any, root: Any, callbacks: list[L.Callback] = (), **kwargs: Any) -> L.Trainer:
    strategy = MegaTrainStrategy() if strategy == "megatrain" else strategy
    checkpointing = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    options = dict(limit_val_batches=None, enable_checkpointing=checkpointing, default_root_dir=root)
    return quiet_trainer(strategy, steps=-1, callbacks=list(callbacks), **(options | kwargs))


def _fit(
    strategy: Any,
    root: Any,
    max_steps: int,
    ckpt_path: Any = None,
    callbacks: list[L.Callback] = (),
    val: bool = False,
    **kwargs: Any,
) -> Run:
    """Fit a fresh ``ScheduledLM`` (its initial weights are overwritten when resuming) on ``TRAIN``."""
    recorder = LossRecorder()
    trainer = _trainer(strategy, root, [recorder, *callbacks], max_steps=max_steps, **kwargs)
    module = ScheduledLM(tiny_model("llama", seed=0 if ckpt_path is None else 7))
    torch.manual_seed(1)
    trainer.fit(module, _loader(TRAIN), _loader(VAL) if val else None, ckpt_path=ckpt_path)
    return Run(module, trainer, recorder.losses)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, tuple[Run, str]]:
    """One epoch under each strategy, saved with ``trainer.save_checkpoint``."""
    root = tmp_path_factory.mktemp("trained")
    runs = {}
    for strategy in STRATEGIES:
        run = _fit(strategy, root / strategy, max_steps=3)
        path = str(root / f"{strategy}.ckpt")
        run.trainer.save_checkpoint(path)
        runs[strategy] = (run, path)
    assert is_checkpoint_dir(runs["megatrain"][1]) and os.path.isfile(runs["auto"][1])
    return runs


def _assert_close(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], exact: bool) -> None:
    assert expected.keys() == actual.keys()
    for name, value in expected.items():
        assert actual[name].dtype == value.dtype and actual[name].shape == value.shape, name
        if exact:
            assert torch.equal(actual[name], value), name
        else:
            assert (actual[name] - value).abs().max() <= 1e-6, name


# -- a megatrain checkpoint read as a standard one --


def test_open_checkpoint_is_the_default_strategys_checkpoint(trained):
    (paged, paged_path), (_, plain_path) = trained["megatrain"], trained["auto"]
    got = torch.load(open_checkpoint(paged_path), weights_only=True)
    expected = torch.load(plain_path, weights_only=True)
    assert got.keys() == expected.keys()
    # Weights: bitwise what the trained module holds, and what the default strategy trained.
    _assert_close(paged.module.state_dict(), got["state_dict"], exact=True)
    _assert_close(expected["state_dict"], got["state_dict"], exact=False)
    # Optimizer: torch.optim.AdamW's own format, numbered by param group.
    (optimizer,), (reference,) = got["optimizer_states"], expected["optimizer_states"]
    assert optimizer["param_groups"] == reference["param_groups"]
    assert optimizer["state"].keys() == reference["state"].keys()
    for i, state in reference["state"].items():
        assert optimizer["state"][i]["step"] == state["step"]
        assert optimizer["state"][i].keys() == state.keys()
        for moment in ("exp_avg", "exp_avg_sq"):
            assert (optimizer["state"][i][moment] - state[moment]).abs().max() <= 1e-6
    for key in ("lr_schedulers", "loops", "global_step", "epoch"):
        assert got[key] == expected[key], key
    # The same line reads the default strategy's single file.
    assert torch.load(open_checkpoint(plain_path), weights_only=True)["global_step"] == 3


def test_load_from_checkpoint_reads_a_megatrain_checkpoint(trained):
    paged, path = trained["megatrain"]
    assert "open_checkpoint" in Path(path, "README.txt").read_text()  # found next to the data
    with pytest.raises(IsADirectoryError):  # why the one-liner exists
        ScheduledLM.load_from_checkpoint(path, model=tiny_model("llama", seed=7))
    loaded = ScheduledLM.load_from_checkpoint(open_checkpoint(path), model=tiny_model("llama", seed=7))
    _assert_close(paged.module.state_dict(), loaded.state_dict(), exact=True)


def test_convert_checkpoint_writes_one_standard_file(trained, tmp_path, capsys):
    paged, path = trained["megatrain"]
    out = tmp_path / "converted.ckpt"
    cli_main(["convert", path, str(out)])
    assert "wrote" in capsys.readouterr().out
    assert os.listdir(tmp_path) == ["converted.ckpt"]  # no temporary file left behind
    converted = torch.load(out, weights_only=True)
    in_memory = torch.load(open_checkpoint(path), weights_only=True)
    _assert_close(paged.module.state_dict(), converted["state_dict"], exact=True)
    assert (
        converted["optimizer_states"][0]["state"].keys() == in_memory["optimizer_states"][0]["state"].keys()
    )
    with pytest.raises(CheckpointError, match="is a directory"):
        convert_checkpoint(path, tmp_path)
    out.write_text("someone's file")
    with pytest.raises(SystemExit):  # the usage error, not another's file overwritten
        cli_main(["convert", path, str(out)])
    assert "exists; nothing was written" in capsys.readouterr().err and out.read_text() == "someone's file"
    with pytest.raises(CheckpointError, match="not a complete megatrain checkpoint"):
        megatrain_lightning.open_checkpoint(tmp_path)


def test_weights_only_checkpoints_open_too(trained, tmp_path):
    paged, _ = trained["megatrain"]
    paged.trainer.save_checkpoint(tmp_path / "weights.ckpt", weights_only=True)
    got = torch.load(open_checkpoint(tmp_path / "weights.ckpt"), weights_only=True)
    assert "optimizer_states" not in got
    _assert_close(paged.module.state_dict(), got["state_dict"], exact=True)


def test_a_compressed_checkpoint_opens_with_decoded_moments(trained, tmp_path):
    run = _fit(MegaTrainStrategy(optimizer_compression="int8"), tmp_path, max_steps=3)
    run.trainer.save_checkpoint(tmp_path / "int8.ckpt")
    got = torch.load(open_checkpoint(tmp_path / "int8.ckpt"), weights_only=True)["optimizer_states"][0]
    reference = torch.load(trained["auto"][1], weights_only=True)["optimizer_states"][0]
    assert got["state"].keys() == reference["state"].keys()
    for i, state in reference["state"].items():
        assert got["state"][i]["step"] == state["step"]
        for moment in ("exp_avg", "exp_avg_sq"):
            # int8 moments of a run that drifted slightly from the fp32 one: a few percent apart (a wrong
            # offset or decoding would be ~100%).
            error = (got["state"][i][moment] - state[moment]).norm() / state[moment].norm()
            assert error < 0.1, (i, moment, float(error))
    convert_checkpoint(tmp_path / "int8.ckpt", tmp_path / "converted.ckpt")
    plain = _fit("auto", tmp_path / "auto", max_steps=5, ckpt_path=tmp_path / "converted.ckpt")
    assert len(plain.losses) == 2 and all(0 < loss < 10 for loss in plain.losses)


def test_open_checkpoint_refuses_what_does_not_fit_in_ram(trained, monkeypatch):
    monkeypatch.setattr(megatrain_lightning.serialization.single_file, "available_ram_bytes", lambda: 1000)
    with pytest.raises(CheckpointError, match="megatrain export"):
        open_checkpoint(trained["megatrain"][1])


# -- resuming across strategies --


def test_default_strategy_resumes_a_converted_megatrain_checkpoint(trained, tmp_path):
    converted = tmp_path / "converted.ckpt"
    convert_checkpoint(trained["megatrain"][1], converted)
    plain = _fit("auto", tmp_path / "auto", max_steps=5, ckpt_path=converted)
    paged = _fit("megatrain", tmp_path / "megatrain", max_steps=5, ckpt_path=trained["megatrain"][1])
    assert plain.trainer.global_step == paged.trainer.global_step == 5 and len(plain.losses) == 2
    assert_same_training(plain, paged)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_megatrain_resumes_a_default_strategy_checkpoint(trained, tmp_path, tier):
    path = trained["auto"][1]
    plain = _fit("auto", tmp_path / "auto", max_steps=5, ckpt_path=path)
    # The disk tier: the loaded weights and moments go into the store through its cache.
    disk = dict(offload_dir=tmp_path / "offload", max_cpu_gb=0.003) if tier == "disk" else {}
    paged = _fit(MegaTrainStrategy(**disk), tmp_path / "megatrain", max_steps=5, ckpt_path=path)
    assert paged.trainer.lr_scheduler_configs[0].scheduler.last_epoch == 5
    assert (
        paged.trainer.optimizers[0].param_groups[0]["lr"] == plain.trainer.optimizers[0].param_groups[0]["lr"]
    )
    assert len(plain.losses) == 2
    assert_same_training(plain, paged)


def _int8_bounds_in_the_store(trainer: L.Trainer, state: dict[int, dict[str, torch.Tensor]]) -> dict:
    """Per parameter number and moment, the int8 codec's error bound on ``state``'s moments as the store
    blocks them: a block's quantized region (its first elements) is cut into scale blocks from its start,
    not from each parameter's, and the bound of a small value depends on its scale block's largest."""
    optimizer, engine = trainer.optimizers[0], trainer.strategy.engine
    bounds: dict[int, dict[str, torch.Tensor]] = {i: {} for i in state}
    for moment, kind in (("exp_avg", "m"), ("exp_avg_sq", "v")):
        for block in engine.blocks:
            flat = torch.zeros(block.numel)
            numbers = [i for i, (b, _) in enumerate(optimizer.order) if b == block.index and i in state]
            for i in numbers:
                spec = block.params[optimizer.order[i][1]]
                flat[spec.offset : spec.offset + spec.numel] = state[i][moment].reshape(-1)
            quantized = optimizer.store.read(block.index, f"{kind}_codes").numel()  # one byte per element
            bound = torch.cat(
                [codecs.error_bound(flat[:quantized], kind, 8), torch.zeros(block.numel - quantized)]
            )
            for i in numbers:
                spec = block.params[optimizer.order[i][1]]
                bounds[i][moment] = bound[spec.offset : spec.offset + spec.numel]
    return bounds


def test_compressed_megatrain_resumes_a_default_strategy_checkpoint(trained, tmp_path):
    path = trained["auto"][1]
    # Restored and saved again without a step: the fp32 moments went through int8 within the codec's bound.
    restored = _fit(MegaTrainStrategy(optimizer_compression="int8"), tmp_path / "restored", 3, ckpt_path=path)
    assert restored.losses == []
    restored.trainer.save_checkpoint(tmp_path / "int8.ckpt")
    got = torch.load(open_checkpoint(tmp_path / "int8.ckpt"), weights_only=True)["optimizer_states"][0]
    expected = torch.load(path, weights_only=True)["optimizer_states"][0]
    assert got["state"].keys() == expected["state"].keys()
    bounds = _int8_bounds_in_the_store(restored.trainer, expected["state"])
    quantized = 0
    for i, state in expected["state"].items():
        assert got["state"][i]["step"] == state["step"]
        for moment in ("exp_avg", "exp_avg_sq"):
            error = (got["state"][i][moment] - state[moment]).abs()
            assert (error <= bounds[i][moment].view_as(error)).all(), (i, moment)
            quantized += bool(error.any())
    assert quantized > 0  # the decoder layers' large weights have int8 moments
    # Training on: the first loss is the plain run's (same weights), the next ones stay close.
    plain = _fit("auto", tmp_path / "auto", max_steps=5, ckpt_path=path)
    paged = _fit(MegaTrainStrategy(optimizer_compression="int8"), tmp_path / "paged", 5, ckpt_path=path)
    assert abs(paged.losses[0] - plain.losses[0]) <= 1e-6 * plain.losses[0]
    assert abs(paged.losses[1] - plain.losses[1]) <= 1e-3 * plain.losses[1]


class TraceProbe(L.Callback):
    """Whether each training pass followed a predicted order of blocks to its end (prefetch and updates at
    each block's last use ran) and how often it deviated."""

    def __init__(self) -> None:
        self.followed: list[bool] = []

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        trace = trainer.strategy.engine.pager.trace
        self.followed.append(trace.following and trace.deviations == 0)


def test_a_resumed_run_follows_the_saved_trace_from_its_first_step(trained, tmp_path):
    """A step without a trace fetches on demand and defers every update to its end (on the disk tier its
    gradients spill); the trace saved with the checkpoint spares the resumed run that step."""
    _, path = trained["megatrain"]
    fresh, resumed = TraceProbe(), TraceProbe()
    _fit("megatrain", tmp_path / "fresh", max_steps=2, callbacks=[fresh])
    _fit("megatrain", tmp_path / "resumed", max_steps=5, ckpt_path=path, callbacks=[resumed])
    assert fresh.followed == [False, True]
    assert resumed.followed == [True, True]


def test_load_state_dict_after_setup(trained, tmp_path):
    plain = trained["auto"][0].module
    module = ScheduledLM(tiny_model("llama", seed=7))
    trainer = _trainer("megatrain", tmp_path)
    before = trainer.validate(module, _loader(VAL), verbose=False)[0]["val_loss"]
    result = module.load_state_dict(plain.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    _assert_close(plain.state_dict(), module.state_dict(), exact=True)
    after = trainer.validate(module, _loader(VAL), verbose=False)[0]["val_loss"]
    expected = _trainer("auto", tmp_path).validate(plain, _loader(VAL), verbose=False)[0]["val_loss"]
    assert after != before and abs(after - expected) <= 1e-6 * abs(expected)
    wrong = {k: v[:1] if k.endswith("q_proj.weight") else v for k, v in plain.state_dict().items()}
    with pytest.raises(RuntimeError, match="size mismatch"):
        module.load_state_dict(wrong)


# -- the disk tier's state dict --


def test_disk_tier_state_dict_is_a_full_copy_or_a_clear_error(tmp_path, monkeypatch):
    strategy = MegaTrainStrategy(offload_dir=tmp_path / "offload")
    run = _fit(strategy, tmp_path, max_steps=2)
    copy = strategy.lightning_module_state_dict()
    _assert_close(run.module.state_dict(), copy, exact=True)
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in copy.values())
    monkeypatch.setattr(megatrain_lightning.store.preflight, "available_ram_bytes", lambda: 1000)
    with pytest.raises(MisconfigurationException, match="trainer.save_checkpoint"):
        strategy.lightning_module_state_dict()
    # Saving streams the weights: it never asks for the full copy (which would raise here).
    run.trainer.save_checkpoint(tmp_path / "disk.ckpt")
    saved = torch.load(open_checkpoint(tmp_path / "disk.ckpt"), weights_only=True)
    _assert_close(copy, saved["state_dict"], exact=True)


# -- what checkpoint hooks and IO plugins see --


class HookedLM(ScheduledLM):
    """Checkpoint hooks as users write them: a key of their own, and (``change``) an entry of the state dict
    dropped in the save or the load hook, which the default strategy would honour."""

    change = ""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["note"] = torch.arange(3)
        if self.change == "save":
            checkpoint["state_dict"].pop("model.model.embed_tokens.weight")

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.note = checkpoint["note"]
        self.seen = {name: (t.shape, t.dtype) for name, t in checkpoint["state_dict"].items()}
        if self.change == "load":
            checkpoint["state_dict"].pop("model.lm_head.weight")


def test_checkpoint_hooks_see_every_weights_name_and_their_changes_are_refused(tmp_path):
    trainer, module = _trainer("megatrain", tmp_path, max_steps=1), HookedLM(tiny_model("llama"))
    trainer.fit(module, _loader(TRAIN))
    trainer.save_checkpoint(tmp_path / "kept.ckpt")
    module.change = "save"
    with pytest.raises(
        MisconfigurationException, match=r"removed 'model.model.embed_tokens.weight'\); megatrain"
    ):
        trainer.save_checkpoint(tmp_path / "changed.ckpt")
    assert not os.path.lexists(tmp_path / "changed.ckpt")
    resumed = HookedLM(tiny_model("llama", seed=7))
    _trainer("megatrain", tmp_path, max_steps=2).fit(
        resumed, _loader(TRAIN), ckpt_path=tmp_path / "kept.ckpt"
    )
    assert resumed.seen == {name: (t.shape, t.dtype) for name, t in module.state_dict().items()}
    assert torch.equal(resumed.note, torch.arange(3))
    changed = HookedLM(tiny_model("llama", seed=7))
    changed.change = "load"
    recorder = LossRecorder()
    with pytest.raises(
        MisconfigurationException, match=r"`on_load_checkpoint`\) changed .* \(removed 'model.lm_head"
    ):
        _trainer("megatrain", tmp_path, [recorder], max_steps=2).fit(
            changed, _loader(TRAIN), ckpt_path=tmp_path / "kept.ckpt"
        )
    assert recorder.losses == []


class UploadingIO(TorchCheckpointIO):
    """A checkpoint IO plugin of the user's (e.g. one that uploads each checkpoint)."""


def test_a_checkpoint_io_plugin_is_refused_and_async_saving_said_to_be_synchronous(tmp_path):
    recorder = LossRecorder()
    with pytest.raises(MisconfigurationException, match="the `UploadingIO` plugin would never be called"):
        _trainer("megatrain", tmp_path, [recorder], max_steps=1, plugins=[UploadingIO()]).fit(
            ScheduledLM(tiny_model("llama")), _loader(TRAIN)
        )
    assert recorder.losses == []
    trainer = _trainer("megatrain", tmp_path, max_steps=1, plugins=[AsyncCheckpointIO()])
    with pytest.warns(UserWarning, match="`AsyncCheckpointIO` is not used"):
        trainer.fit(ScheduledLM(tiny_model("llama")), _loader(TRAIN))
    trainer.save_checkpoint(tmp_path / "async.ckpt")
    assert is_checkpoint_dir(tmp_path / "async.ckpt")


# -- the feature matrix: each feature as under the default strategy --


def _checkpoint_callbacks(dirpath: Any) -> list[L.Callback]:
    return [
        ModelCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=2, save_last=True),
        # Random tokens: val_loss rises from the second epoch on, so this stops after three epochs.
        EarlyStopping(monitor="val_loss", patience=2),
    ]


def test_model_checkpoint_early_stopping_and_resume_from_last(tmp_path):
    runs = {}
    for strategy in STRATEGIES:
        callbacks = _checkpoint_callbacks(tmp_path / strategy / "ckpts")
        run = _fit(strategy, tmp_path / strategy, max_steps=30, callbacks=callbacks, val=True)
        checkpoint, stopping = callbacks
        runs[strategy] = (run, checkpoint, stopping)
    (plain, plain_ckpt, plain_stop), (paged, paged_ckpt, paged_stop) = runs["auto"], runs["megatrain"]
    assert paged_stop.stopped_epoch == plain_stop.stopped_epoch > 0
    assert paged.trainer.global_step == plain.trainer.global_step < 30
    assert_same_training(plain, paged)
    best = {os.path.basename(p): float(s) for p, s in plain_ckpt.best_k_models.items()}
    got = {os.path.basename(p): float(s) for p, s in paged_ckpt.best_k_models.items()}
    assert best.keys() == got.keys() and len(best) == 2
    assert all(abs(got[k] - v) <= 1e-6 * abs(v) for k, v in best.items())
    assert os.path.basename(paged_ckpt.best_model_path) == os.path.basename(plain_ckpt.best_model_path)
    assert is_checkpoint_dir(paged_ckpt.last_model_path) and os.path.isfile(plain_ckpt.last_model_path)
    # Testing the best checkpoint restores its weights: its test loss on the validation data is its val_loss.
    tested = {
        strategy: run.trainer.test(run.module, _loader(VAL), ckpt_path="best", verbose=False)[0]["test_loss"]
        for strategy, (run, _, _) in runs.items()
    }
    best_score = float(plain_ckpt.best_model_score)
    assert abs(tested["auto"] - best_score) <= 1e-6 * best_score
    assert abs(tested["megatrain"] - best_score) <= 1e-6 * best_score
    # A new Trainer resumes from "last", found by its ModelCheckpoint; which step "last" holds and how the
    # restart replays its epoch is Lightning's business, the same under both strategies.
    steps = plain.trainer.global_step + 2
    resumed = {
        strategy: _fit(
            strategy,
            tmp_path / strategy,
            max_steps=steps,
            ckpt_path="last",
            callbacks=[ModelCheckpoint(dirpath=tmp_path / strategy / "ckpts", save_last=True)],
        )
        for strategy in STRATEGIES
    }
    assert resumed["megatrain"].trainer.global_step == resumed["auto"].trainer.global_step == steps
    assert len(resumed["auto"].losses) < steps  # resumed, not trained from scratch
    assert_same_training(resumed["auto"], resumed["megatrain"])


def test_validate_test_predict_after_fit(trained):
    results = {}
    for strategy in STRATEGIES:
        run, _ = trained[strategy]
        trainer, module = run.trainer, run.module
        results[strategy] = (
            trainer.validate(module, _loader(VAL), verbose=False)[0]["val_loss"],
            trainer.test(module, _loader(VAL), verbose=False)[0]["test_loss"],
            torch.cat(trainer.predict(module, _loader(VAL))),
        )
    (val, test, logits), (paged_val, paged_test, paged_logits) = results["auto"], results["megatrain"]
    assert abs(paged_val - val) <= 1e-6 * abs(val) and abs(paged_test - test) <= 1e-6 * abs(test)
    assert (paged_logits - logits).abs().max() <= 1e-6
