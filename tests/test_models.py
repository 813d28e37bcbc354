"""Tests of the tiny configs, CausalLMModule and the Hydra training app (plain strategy)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import LossRecorder, LRRecorder, quiet_trainer
from transformers import AutoModelForCausalLM
from zoo import tiny_zoo_config

from megatrain_lightning.data import TextDataModule
from megatrain_lightning.models import CausalLMModule, warmup_cosine
from megatrain_lightning.presets import TINY_ARCHS, llama_config, tiny_config
from megatrain_lightning.serialization.initialization import InitRecorder, initialize
from megatrain_lightning.serialization.meta import init_on_meta

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "megatrain_lightning" / "configs"


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_config_builds_and_runs(arch):
    config = tiny_config(arch)
    assert config.vocab_size == 256
    dropouts = {k: v for k, v in config.to_dict().items() if "dropout" in k or "pdrop" in k}
    assert all(v == 0 for v in dropouts.values()), dropouts
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 256, (2, 16))
    out = model(input_ids=ids, labels=ids, use_cache=False)
    assert out.logits.shape == (2, 16, 256)
    assert torch.isfinite(out.loss) and abs(out.loss.item() - math.log(256)) < 1.0
    assert sum(p.numel() for p in model.parameters()) < 400_000


def test_tiny_config_ties_and_overrides():
    assert tiny_config("gpt2").tie_word_embeddings is True
    assert tiny_config("llama").tie_word_embeddings is False
    assert tiny_config("llama", num_hidden_layers=4).num_hidden_layers == 4
    with pytest.raises(ValueError, match="unknown tiny arch"):
        tiny_config("bert")


def test_llama_config_shapes():
    c = llama_config("170m")
    shape = (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.intermediate_size)
    assert shape == (1024, 8, 16, 2816)
    assert (c.vocab_size, c.max_position_embeddings, c.tie_word_embeddings) == (32000, 2048, False)
    with torch.device("meta"):
        n_170m = sum(p.numel() for p in AutoModelForCausalLM.from_config(c).parameters())
        n_7b = sum(p.numel() for p in AutoModelForCausalLM.from_config(llama_config("7b")).parameters())
    assert 160e6 < n_170m < 180e6
    assert 6.6e9 < n_7b < 6.8e9  # Llama-2-7B: 6.74B
    c70 = llama_config("70b")
    assert (c70.hidden_size, c70.num_hidden_layers, c70.num_key_value_heads) == (8192, 80, 8)
    assert llama_config("1b").hidden_size == 2048
    with pytest.raises(ValueError, match="unknown Llama size"):
        llama_config("13b")


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_param_groups_split_by_ndim(arch):
    module = CausalLMModule(arch, weight_decay=0.1)
    module.configure_model()
    decay, no_decay = module.param_groups()
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    unique = {id(p): p for p in module.parameters()}
    assert {id(p) for p in no_decay["params"]} == {i for i, p in unique.items() if p.ndim < 2}
    assert {id(p) for p in decay["params"]} == {i for i, p in unique.items() if p.ndim >= 2}
    all_ids = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert len(all_ids) == len(set(all_ids)) == len(unique)


def test_tied_gpt2_weight_appears_once():
    module = CausalLMModule("gpt2")
    module.configure_model()
    wte = module.model.transformer.wte.weight
    assert module.model.lm_head.weight is wte
    params = [p for g in module.param_groups() for p in g["params"]]
    assert sum(p is wte for p in params) == 1


def test_optimizer_on_meta_parameters():
    """The strategy builds the model on meta: groups and schedule must only use shapes."""
    module = CausalLMModule("llama", lr=1e-3, warmup_steps=2, max_steps=10)
    with torch.device("meta"):
        module.configure_model()
    assert all(p.is_meta for p in module.parameters())
    cfg = module.configure_optimizers()
    opt, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
    assert isinstance(opt, torch.optim.AdamW) and cfg["lr_scheduler"]["interval"] == "step"
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-8
    assert [g["lr"] for g in opt.param_groups] == [5e-4, 5e-4]  # step 0 of 2 warmup steps
    assert "lr_lambdas" in sched.state_dict()


def test_warmup_cosine_and_constant_schedules():
    f = warmup_cosine(warmup_steps=4, total_steps=14)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0 and f(9) == pytest.approx(0.5) and f(14) == pytest.approx(0.0) and f(100) == 0.0
    assert warmup_cosine(2, None)(50) == 1.0
    module = CausalLMModule("llama", scheduler="constant")
    module.configure_model()
    assert set(module.configure_optimizers()) == {"optimizer"}
    with pytest.raises(ValueError, match="scheduler"):
        CausalLMModule("llama", scheduler="linear")


@pytest.mark.parametrize("strategy", ["auto", "megatrain"])
def test_resuming_with_more_steps_stretches_the_schedule(tmp_path, strategy):
    """Raising max_steps to train on from a checkpoint follows the cosine of the new length from the
    first resumed step, as with transformers' schedulers; the schedule saved in the checkpoint would
    end at the old one (lr 0)."""
    dm = TextDataModule(seq_len=32, batch_size=2)
    first = quiet_trainer(strategy, 4, [])
    first.fit(CausalLMModule("llama", lr=1e-3), datamodule=dm)
    first.save_checkpoint(tmp_path / "step4.ckpt")
    recorder = LRRecorder()
    quiet_trainer(strategy, 8, [recorder]).fit(
        CausalLMModule("llama", lr=1e-3), datamodule=dm, ckpt_path=tmp_path / "step4.ckpt"
    )
    assert [lr for lr, _ in recorder.seen] == pytest.approx(
        [1e-3 * 0.5 * (1 + math.cos(math.pi * s / 8)) for s in range(4, 8)]
    )


def test_model_sources(tmp_path):
    # An already built model is kept as is.
    built = AutoModelForCausalLM.from_config(tiny_config("gpt2"))
    module = CausalLMModule(built)
    assert module.model is built
    module.configure_model()
    assert module.model is built
    assert module.hparams.model["model_type"] == "gpt2"
    # ... and its hparams rebuild the same architecture.
    rebuilt = CausalLMModule(module.hparams.model)
    rebuilt.configure_model()
    assert type(rebuilt.model) is type(built)
    # A local Hugging Face directory: config and weights.
    built.save_pretrained(tmp_path / "hf")
    from_dir = CausalLMModule(str(tmp_path / "hf"))
    assert from_dir.pretrained_path == str(tmp_path / "hf")
    from_dir.configure_model()
    for (name, a), b in zip(built.state_dict().items(), from_dir.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="no such directory"):
        CausalLMModule(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="neither a tiny arch"):
        CausalLMModule("llama2")


class _LossRecorder(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def test_fit_lowers_loss_on_shipped_corpus(tmp_path):
    L.seed_everything(0)
    recorder = _LossRecorder()
    module = CausalLMModule("llama", lr=1e-3, warmup_steps=3)
    dm = TextDataModule(seq_len=128, batch_size=8)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=30,
        strategy="auto",
        callbacks=[recorder],
        limit_val_batches=2,
        val_check_interval=30,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=dm)
    losses = recorder.losses
    assert len(losses) == 30
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert first > 5.0 and last < first - 1.0, losses
    metrics = trainer.callback_metrics
    val_loss, val_ppl = float(metrics["val_loss"]), float(metrics["val_ppl"])
    assert val_ppl == pytest.approx(math.exp(val_loss), rel=1e-3)

    (test_metrics,) = trainer.test(module, datamodule=dm, verbose=False)
    assert test_metrics["test_ppl"] == pytest.approx(math.exp(test_metrics["test_loss"]), rel=1e-3)
    preds = trainer.predict(module, dataloaders=dm.predict_dataloader())
    assert preds[0].shape == (8, 128) and preds[0].dtype == torch.long


def test_hydra_configs_compose():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="train")
        assert cfg.strategy._target_ == "megatrain_lightning.MegaTrainStrategy"
        # The default pages the store through a folder of the run; `strategy=megatrain` keeps it in RAM.
        assert OmegaConf.to_container(cfg.strategy)["offload_dir"] == "${hydra:runtime.output_dir}/offload"
        cfg = compose(config_name="train", overrides=["strategy=megatrain"])  # every option: test_hydra_app
        assert (
            cfg.strategy._target_ == "megatrain_lightning.MegaTrainStrategy"
            and cfg.strategy.offload_dir is None
        )
        assert cfg.model.model == "llama" and cfg.data.path is None
        assert compose(config_name="train", overrides=["strategy=plain"]).strategy == "auto"
        for name in ("tiny_gpt2", "tiny_moe", "llama_170m", "llama_1b", "llama_7b", "llama_70b"):
            assert compose(config_name="train", overrides=[f"model={name}"]).model._target_


def test_hydra_app_runs_with_plain_strategy(tmp_path):
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=pythonpath)
    cmd = [
        sys.executable,
        "-m",
        "megatrain_lightning.train",
        "strategy=plain",
        "trainer.max_steps=3",
        "+trainer.enable_progress_bar=false",
        f"hydra.run.dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "final train_loss:" in proc.stdout
    assert (tmp_path / "lightning_logs").is_dir()


class _BuildsInConfigureModel(CausalLMModule):
    """A user's module that builds its Hugging Face model in ``configure_model`` itself."""

    def __init__(self, arch: str) -> None:
        super().__init__(arch)

    def configure_model(self) -> None:
        if self.model is None:
            self.model = AutoModelForCausalLM.from_config(self.config)


class _ResizesInConfigureModel(_BuildsInConfigureModel):
    """Then adds tokens, as users do for a tokenizer's new special tokens (new rows drawn around the mean)."""

    def configure_model(self) -> None:
        if self.model is None:
            super().configure_model()
            self.model.resize_token_embeddings(300)


def _first_losses(make_module, strategy: str, steps: int = 2) -> list[float]:
    L.seed_everything(7)
    module = make_module()
    recorder = LossRecorder()
    trainer = quiet_trainer(strategy, steps, [recorder])
    trainer.fit(module, datamodule=TextDataModule(seq_len=16, batch_size=2))
    return recorder.losses


@pytest.mark.parametrize(
    "make_module",
    [
        pytest.param(lambda: CausalLMModule("gpt2"), id="configure_model-tied"),
        pytest.param(lambda: CausalLMModule("qwen2_moe"), id="configure_model-moe"),
        pytest.param(
            lambda: CausalLMModule(AutoModelForCausalLM.from_config(tiny_config("llama"))), id="init"
        ),
        pytest.param(lambda: _BuildsInConfigureModel("llama"), id="user-configure_model"),
        pytest.param(lambda: _ResizesInConfigureModel("llama"), id="user-configure_model-resized"),
    ],
)
def test_same_seed_same_start_under_plain_and_megatrain(make_module):
    """Switching the strategy must not change the initial weights: the first losses are equal."""
    plain = _first_losses(make_module, "auto")
    paged = _first_losses(make_module, "megatrain")
    assert paged == pytest.approx(plain, rel=1e-6)


def _unrecorded(module: torch.nn.Module) -> None:
    raise AssertionError(f"{type(module).__name__} was not recorded")


def _resized(tokens: int | None) -> Callable[[torch.nn.Module], None]:
    """Hugging Face's resize to ``tokens`` (``None``: none), the new rows drawn around the old ones' mean
    (its default) where it grows, from the initializer where it shrinks."""

    def finish(model: torch.nn.Module) -> None:
        if tokens is not None:
            model.resize_token_embeddings(tokens, mean_resizing=tokens > 256)

    return finish


@pytest.mark.parametrize(
    ("arch", "tokens"),
    [("llama", None), ("gpt2", None), ("qwen2_moe", None), ("qwen3_next", None), ("mamba", None)]
    + [("olmo_hybrid", None)]
    + [("llama", 300), ("llama", 200), ("gpt2", 300)],
)
def test_recorded_meta_build_replays_to_the_plain_build(arch, tokens):
    """Replayed module by module in any order (as the store is filled), the recorded initialization gives
    the plain build's weights, and the generator ends where the plain build leaves it: Qwen3-Next's `A_log`
    copied from a view of its own storage, Mamba's computed from `torch.arange` and `torch.rand` on meta,
    the embeddings `resize_token_embeddings` grows or shrinks (the old rows copied into a new weight, whose
    storage the old parameter then takes over; new rows drawn from the old ones' mean and covariance)."""
    finish = _resized(tokens)
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(tiny_zoo_config(arch))
    finish(plain)
    after_plain = torch.get_rng_state()
    torch.manual_seed(0)
    with init_on_meta(), InitRecorder() as recorder, InitRecorder() as nested:  # e.g. strategy and module
        built = AutoModelForCausalLM.from_config(tiny_zoo_config(arch))
        finish(built)
    nested.install(built)
    recorder.install(built)
    assert torch.equal(torch.get_rng_state(), after_plain)
    built.to_empty(device="cpu")
    built.tie_weights()
    for module in reversed(list(built.modules())):
        initialize(module, model_init=_unrecorded)
    assert torch.equal(torch.get_rng_state(), after_plain)  # replaying draws nothing new
    expected, actual = plain.state_dict(), built.state_dict()
    assert all(torch.equal(expected[k], actual[k]) for k in expected)


class _InitsOfEveryKind(torch.nn.Module):
    """A plain-PyTorch model initialized with torch.nn.init's functions that skip a tensor on meta
    (``trunc_normal_`` with its rejection loop and without, ``orthogonal_``, ``sparse_``, ``dirac_``),
    with a generator of its own, from values made on the CPU (a large table drawn there; an index
    buffer's values) and from Python data on the weights' device."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.proj = torch.nn.Linear(16, 32)
        self.gate = torch.nn.Linear(32, 16)
        self.conv = torch.nn.Conv1d(4, 4, 3)
        torch.nn.init.trunc_normal_(self.embed.weight, std=0.02, a=-0.04, b=0.04)  # rejection loop
        torch.nn.init.orthogonal_(self.proj.weight)
        torch.nn.init.sparse_(self.gate.weight, sparsity=0.5)
        torch.nn.init.dirac_(self.conv.weight)
        torch.nn.init.trunc_normal_(self.gate.weight, std=1.0, a=-0.1, b=0.1)  # the inverse-CDF branch
        torch.nn.init.normal_(self.proj.bias, generator=generator)
        torch.nn.init.uniform_(self.gate.bias, generator=generator)
        self.table = torch.nn.Parameter(torch.randn(1024, 512) * 0.02)  # 2 MiB drawn on the CPU
        with torch.no_grad():
            self.conv.bias.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0], device=self.conv.weight.device))


class _WritesOfEveryKind(torch.nn.Module):
    """Users' writes that reach a weight other than by an in-place op on it: ``eye_`` (``torch.eye``'s
    ``out=``), ``.data =`` a CPU tensor or a tensor computed from the weight (whose old storage is then
    free for the next tensor made), buffers made on the weights' device, ``spectral_norm`` (its vectors'
    power iteration, each step reading the other's last state)."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 32)
        self.gate = torch.nn.Linear(32, 16)
        torch.nn.init.eye_(self.proj.weight[:16])
        self.proj.bias.data = torch.randn(32, generator=generator)
        self.gate.weight.data = self.gate.weight.data * 0.5
        self.more = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.register_buffer("positions", torch.arange(8, device=self.proj.weight.device))
        self.register_buffer("ones", torch.ones_like(self.gate.weight))
        torch.nn.utils.parametrizations.spectral_norm(self.more[0])


@pytest.mark.parametrize("model_cls", [_InitsOfEveryKind, _WritesOfEveryKind])
def test_a_meta_build_replays_to_the_plain_build_whatever_the_init_writes_with(model_cls):
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    plain = model_cls(generator)
    after_plain = torch.get_rng_state(), generator.get_state()
    generator.manual_seed(1)
    torch.manual_seed(0)
    with init_on_meta(), InitRecorder() as recorder:
        built = model_cls(generator)
    recorder.install(built)
    for module in built.modules():  # the parameters' memory, as the store gives it (the buffers are real)
        for name, param in module._parameters.items():
            module._parameters[name] = torch.nn.Parameter(torch.empty_like(param, device="cpu"))
    generator.manual_seed(5)  # a replay draws from the state each op was recorded with
    for module in reversed(list(built.modules())):
        initialize(module, model_init=_unrecorded)
    assert torch.equal(torch.get_rng_state(), after_plain[0])
    assert torch.equal(generator.get_state(), torch.Generator().manual_seed(5).get_state())
    expected, actual = plain.state_dict(), built.state_dict()
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[k], actual[k]) for k in expected)


class _EmptyThenInitialized(torch.nn.Module):
    """A weight made by ``torch.empty`` on the CPU and written only by its init, as ``nn.Linear``'s."""

    def __init__(self) -> None:
        super().__init__()
        weight = torch.nn.Parameter(torch.empty(256, 256))  # the memory outlives the tensor `empty` made
        self.memory = weakref.ref(weight.untyped_storage())
        self.weight = weight
        torch.nn.init.normal_(self.weight)


def test_a_meta_build_does_not_hold_the_cpu_memory_of_weights_its_inits_write():
    torch.manual_seed(0)
    plain = _EmptyThenInitialized()
    torch.manual_seed(0)
    with init_on_meta(), InitRecorder() as recorder:
        built = _EmptyThenInitialized()
    recorder.install(built)
    assert built.memory() is None  # the recorder keeps no copy of the uninitialized memory
    built.to_empty(device="cpu")
    initialize(built, model_init=_unrecorded)
    assert torch.equal(built.weight, plain.weight)
