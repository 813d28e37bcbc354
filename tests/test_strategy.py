"""The Lightning side: registration, precision, evaluation loops, where the weights live, bad input."""

from __future__ import annotations

import gc
import os
import weakref

import lightning as L
import pytest
import torch
from conftest import UserLM, assert_same_training, fit, fit_module, tiny_model, user_fit
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import nn

import megatrain_lightning  # noqa: F401  (registers "megatrain")
from megatrain_lightning import CPUAdamW, MegaTrainPrecision, MegaTrainStrategy
from megatrain_lightning.data import TextDataModule
from megatrain_lightning.engine.placeholders import ParamPlaceholder
from megatrain_lightning.models import CausalLMModule
from megatrain_lightning.presets import tiny_config


def _trainer(strategy="megatrain", **kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(strategy=strategy, **(defaults | kwargs))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_registered_name_and_precision_string_end_up_as_ours(precision):
    trainer = _trainer(precision=precision)
    assert isinstance(trainer.strategy, MegaTrainStrategy)
    assert isinstance(trainer.strategy.precision_plugin, MegaTrainPrecision)
    assert trainer.strategy.precision_plugin.precision == precision


def test_instance_with_options():
    strategy = MegaTrainStrategy(
        max_vram_gb=0.5, max_cpu_gb=2, activation_checkpointing=False, prefetch_depth=2
    )
    assert _trainer(strategy).strategy is strategy


def test_lightnings_own_keywords_pass_and_a_misspelt_option_names_the_closest():
    from lightning.fabric.plugins import TorchCheckpointIO

    io = TorchCheckpointIO()
    strategy = MegaTrainStrategy(parallel_devices=[torch.device("cpu")], checkpoint_io=io)
    assert strategy.checkpoint_io is io and strategy.parallel_devices == [torch.device("cpu")]
    with pytest.raises(MisconfigurationException, match="no option `io_thread`. Did you mean `io_threads`"):
        MegaTrainStrategy(io_thread=2)


def test_weights_move_into_the_store_and_the_originals_are_freed():
    model = tiny_model("gpt2")
    originals = [weakref.ref(p) for p in model.parameters()]
    module = CausalLMModule(model, lr=1e-3)
    trainer = _trainer(max_steps=3, num_sanity_val_steps=0, limit_val_batches=0)
    del model
    trainer.fit(module, datamodule=TextDataModule(seq_len=32, batch_size=2))
    gc.collect()
    assert all(ref() is None for ref in originals), "a full copy of the model is still alive"
    assert all(isinstance(p, ParamPlaceholder) for p in module.parameters())  # no storage
    # Tied weights are stored once and stay tied.
    gpt2 = module.model
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    state = trainer.strategy.lightning_module_state_dict()
    assert torch.equal(state["model.lm_head.weight"], state["model.transformer.wte.weight"])
    params = list(module.parameters())  # de-duplicated: the tied weight counts once
    numel = sum(p.numel() for p in params)
    padding = 4 * 256 * len(params)  # each parameter starts on a 256-element boundary
    stats = trainer.strategy.stats
    pages = 4096 * len(trainer.strategy.engine.blocks)  # each buffer is whole pages
    assert 4 * numel <= trainer.strategy.engine.store.nbytes("param") <= 4 * numel + padding + pages
    # store: master + exp_avg + exp_avg_sq = 12 bytes per parameter, and the gradient sums of the blocks
    # between their backward and their update (a buffer per block size), not 4 more per parameter
    assert 12 * numel <= stats.host_bytes < 16 * numel
    assert stats.peak_slot_bytes == stats.h2d_bytes == 0 < stats.fetch_wait_s  # zero copy on the CPU


def test_model_built_in_configure_model_is_initialized_block_by_block():
    module = CausalLMModule("llama", lr=3e-3, max_steps=30)
    trainer = _trainer(limit_val_batches=1)
    trainer.validate(module, datamodule=TextDataModule(seq_len=32, batch_size=4))
    assert all(isinstance(p, ParamPlaceholder) for p in module.parameters())  # no storage
    state = trainer.strategy.lightning_module_state_dict()
    # Initialized the Hugging Face way: norms at one, linear weights ~ N(0, initializer_range).
    assert torch.equal(state["model.model.norm.weight"], torch.ones(64))
    assert state["model.model.layers.1.mlp.up_proj.weight"].std().item() == pytest.approx(0.02, rel=0.1)
    # The paged model and a plain copy of its weights compute the same logits.
    reference = CausalLMModule("llama")
    reference.configure_model()
    reference.load_state_dict(state)
    batch = torch.randint(0, 256, (2, 16))
    paged = trainer.predict(module, torch.utils.data.DataLoader([batch], batch_size=None))[0]
    assert torch.equal(paged, reference.model(input_ids=batch).logits.argmax(-1))
    # And it trains.
    trainer = _trainer(
        max_steps=30, num_sanity_val_steps=0, limit_val_batches=0
    )  # a new strategy, same store
    trainer.fit(module, datamodule=TextDataModule(seq_len=32, batch_size=4))
    assert trainer.callback_metrics["train_loss"] < 4.5


def test_validate_test_and_predict_run_paged_and_match_plain():
    model = tiny_model("llama")
    data = TextDataModule(seq_len=32, batch_size=4)
    results = {}
    for name, strategy in [("plain", "auto"), ("paged", MegaTrainStrategy(max_vram_gb=2e-4))]:
        module = CausalLMModule(tiny_model("llama"))
        module.model.load_state_dict(model.state_dict())
        trainer = _trainer(strategy, limit_val_batches=3, limit_test_batches=3, limit_predict_batches=2)
        val = trainer.validate(module, datamodule=data)[0]
        test = trainer.test(module, datamodule=data)[0]
        predicted = trainer.predict(module, datamodule=data)
        results[name] = (val, test, predicted)
    (pv, pt, pp), (mv, mt, mp) = results["plain"], results["paged"]
    assert mv["val_loss"] == pytest.approx(pv["val_loss"], rel=1e-6)
    assert mt["test_ppl"] == pytest.approx(pt["test_ppl"], rel=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(pp, mp, strict=True))


def test_bf16_mixed_trains_with_fp32_masters():
    run = fit(tiny_model("llama"), "megatrain", steps=40, lr=3e-3, precision="bf16-mixed", batch_size=4)
    engine = run.trainer.strategy.engine
    assert engine.pager.layout.compute_dtype == torch.bfloat16
    assert all(
        engine.store.read(b.index, kind).dtype == torch.float32
        for b in engine.blocks
        for kind in ("param", "grad", "exp_avg", "exp_avg_sq")
    )
    assert all(v.dtype == torch.float32 for v in run.state_dict().values() if v.is_floating_point())
    first, last = sum(run.losses[:5]) / 5, sum(run.losses[-5:]) / 5
    assert last < first - 0.5


def test_optimizer_is_rebuilt_and_the_scheduler_follows_it():
    run = fit(tiny_model("llama"), MegaTrainStrategy(), steps=5)
    optimizer = run.trainer.optimizers[0]
    assert isinstance(optimizer, CPUAdamW)
    scheduler = run.trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.optimizer is optimizer
    assert optimizer.param_groups[0]["lr"] == pytest.approx(scheduler.get_last_lr()[0])


# -- bad input: a clear MisconfigurationException before training starts --


def test_budget_smaller_than_the_largest_block():
    with pytest.raises(MisconfigurationException, match="smaller than the largest block"):
        fit(tiny_model("llama"), MegaTrainStrategy(max_vram_gb=1e-6), steps=1)


def test_disk_tier_options_without_a_disk_tier_are_said_to_change_nothing():
    with pytest.warns(
        UserWarning, match="`max_cpu_gb` and `io_threads` size the disk tier; without `offload_dir`"
    ):
        fit(tiny_model("llama"), MegaTrainStrategy(max_cpu_gb=1, io_threads=8), steps=1)


@pytest.mark.parametrize("budget", [-1, 0, "8GB", float("nan"), True])
def test_negative_or_non_numeric_budgets(budget):
    with pytest.raises(MisconfigurationException, match="positive number"):
        MegaTrainStrategy(max_vram_gb=budget)
    with pytest.raises(MisconfigurationException, match="positive number"):
        MegaTrainStrategy(max_cpu_gb=budget)


class _NoBlocks(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))

    def training_step(self, batch, batch_idx):
        return self.net(batch).sum()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def test_no_detectable_blocks():
    with pytest.raises(MisconfigurationException, match="block_classes"):
        _trainer(max_steps=1).fit(_NoBlocks(), torch.utils.data.DataLoader(torch.randn(4, 4)))


def test_named_block_classes_make_any_model_pageable():
    module = _NoBlocks()
    trainer = _trainer(MegaTrainStrategy(block_classes=[nn.Linear]), max_steps=2)
    trainer.fit(module, torch.utils.data.DataLoader(torch.randn(4, 4)))
    assert len(trainer.strategy.engine.blocks) == 2


def test_unsupported_optimizer():
    module = CausalLMModule(tiny_model("llama"))
    module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.raises(
        MisconfigurationException, match="supports `torch.optim.AdamW` and `torch.optim.Adam`"
    ):
        _trainer(max_steps=1).fit(module, datamodule=TextDataModule(seq_len=32, batch_size=2))


def test_unsupported_precision_and_options():
    with pytest.raises(MisconfigurationException, match="precision"):
        _trainer(precision="64-true")
    with pytest.raises(MisconfigurationException, match="optimizer_compression"):
        MegaTrainStrategy(optimizer_compression="int1")
    with pytest.raises(MisconfigurationException, match="prefetch_depth"):
        MegaTrainStrategy(prefetch_depth=-1)


def test_offload_dir_that_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(MisconfigurationException, match="not a directory"):
        MegaTrainStrategy(offload_dir=path)


def test_tiny_configs_cover_the_block_classes():
    for arch in ("llama", "gpt2", "qwen2_moe", "mixtral"):
        assert tiny_config(arch).model_type


def test_auto_budgets_come_from_the_planner():
    from megatrain_lightning.planner.plan import Machine, ModelShape, Workload, plan_for
    from megatrain_lightning.serialization.hf import hf_model

    run = fit(tiny_model("llama"), MegaTrainStrategy(zero_copy=False), steps=1)
    engine = run.trainer.strategy.engine
    shape = ModelShape.from_blocks([b.numel for b in engine.blocks], hf_model(run.module)[1].config)
    workload = Workload(compute_dtype="fp32", zero_copy=False)
    settings = plan_for(shape, Machine.detect("cpu"), "none", workload).settings
    assert engine.config.slot_pools == settings.slot_pools
    assert engine.pager.num_slots == settings.num_slots >= 1


def test_auto_slots_on_the_cpu_are_counted_in_its_ram(tmp_path):
    """Where the CPU computes, slots are RAM beside the disk tier's cache: two (one block loads while the
    other computes), the rest of the RAM for the cache; not a slot for every block on top of it."""
    run = fit(tiny_model("llama"), MegaTrainStrategy(offload_dir=tmp_path), steps=1)
    engine = run.trainer.strategy.engine
    assert len(engine.blocks) > 2 and engine.pager.num_slots == 2


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_forward_without_backward_frees_its_graph_without_the_garbage_collector(checkpointing):
    """Evaluation with gradients on (or a discarded loss) must not leave graphs behind: a reference
    cycle through autograd's C++ nodes is invisible to the collector and would keep slots alive."""
    from megatrain_lightning.engine.runtime import Engine, EngineConfig

    model = tiny_model("llama")
    config = EngineConfig(device=torch.device("cpu"), activation_checkpointing=checkpointing)
    engine = Engine.attach(model, None, lambda blocks: config)
    ids = torch.randint(0, model.config.vocab_size, (1, 8))

    def graph_nodes() -> set[int]:
        return {id(o) for o in gc.get_objects() if type(o).__name__ == "_PagedCallBackward"}

    gc.collect()
    gc.disable()
    try:
        before = graph_nodes()  # other tests' graphs that something still holds
        for _ in range(3):
            engine.begin_pass("train")
            logits = model(input_ids=ids).logits
            assert logits.requires_grad
            del logits
        leaked = graph_nodes() - before
    finally:
        gc.enable()
        engine.close()
    assert not leaked


def test_the_engine_is_freed_with_its_trainer_while_the_model_keeps_its_weights():
    """Once the trainer is dropped (with the LightningModule, which Lightning ties to it), the engine
    (slots, threads, gradients, optimizer state) is freed by reference counting and one collection; the
    Hugging Face model the user kept has its trained weights, runs, and trains on from them."""
    run = user_fit(tiny_model("llama"), MegaTrainStrategy(), steps=2)
    hf, engine = run.module.model, run.trainer.strategy.engine
    store, engine_ref = engine.store, weakref.ref(engine)
    trained = {k.removeprefix("model."): v.clone() for k, v in run.module.state_dict().items()}
    assert store.nbytes("exp_avg") > 0
    del run, engine
    gc.collect()
    assert engine_ref() is None
    assert store.nbytes() == store.nbytes("param")  # gradients and moments went with the engine
    kept = hf.state_dict()
    assert kept.keys() == trained.keys() and all(torch.equal(kept[k], trained[k]) for k in kept)
    reference = tiny_model("llama")
    reference.load_state_dict(kept)
    ids = torch.randint(0, reference.config.vocab_size, (2, 8))
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids).logits, reference(input_ids=ids).logits)
    for model in (reference, hf):  # a training loop of the user's own, as in plain PyTorch
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(input_ids=ids, labels=ids).loss.backward()
        assert model.model.layers[0].mlp.up_proj.weight.grad is not None
        optimizer.step()
        optimizer.zero_grad()
    stepped, reference_stepped = hf.state_dict(), reference.state_dict()
    assert all(torch.equal(stepped[k], reference_stepped[k]) for k in stepped)
    assert not torch.equal(stepped["lm_head.weight"], trained["lm_head.weight"])
    assert_same_training(
        fit_module(UserLM(reference), "auto", steps=2), fit_module(UserLM(hf), MegaTrainStrategy(), steps=2)
    )


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_close_gives_the_module_back_plain(tmp_path, tier):
    """``Engine.close`` leaves the module as it was before megatrain: its own forwards, no hooks, real
    parameters: the trained weights on the host tier, meta tensors on the disk tier (its files are gone)."""
    kwargs = {"offload_dir": str(tmp_path)} if tier == "disk" else {}
    run = user_fit(tiny_model("llama"), MegaTrainStrategy(**kwargs), steps=2)
    hf, engine = run.module.model, run.trainer.strategy.engine
    trained = {k.removeprefix("model."): v.clone() for k, v in run.module.state_dict().items()}
    engine.close()
    params = dict(hf.named_parameters())
    assert not any(isinstance(p, ParamPlaceholder) for p in params.values())
    assert not any("forward" in m.__dict__ for m in hf.modules())
    assert not any(m._state_dict_hooks or m._load_state_dict_pre_hooks for m in hf.modules())
    if tier == "disk":
        assert all(p.is_meta for p in params.values()) and not os.listdir(tmp_path)
        return
    kept = hf.state_dict()
    assert all(torch.equal(kept[k], trained[k]) for k in trained)
    ids = torch.randint(0, hf.config.vocab_size, (2, 8))
    reference = tiny_model("llama")
    reference.load_state_dict(kept)
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_a_dropped_run_frees_its_disk_store_in_one_collection(tmp_path):
    """Nothing global keeps a finished run's module, weights or store: dropping them and one collection
    removes the offload folder's files."""
    from megatrain_lightning.store.files import STORE_DIRNAME

    run = user_fit(tiny_model("llama"), MegaTrainStrategy(offload_dir=str(tmp_path)), steps=2)
    assert (tmp_path / STORE_DIRNAME).exists()
    del run
    gc.collect()
    assert not (tmp_path / STORE_DIRNAME).exists()
