"""Lightning features around the optimizer work as under the default strategy: every torch LR scheduler,
``LearningRateMonitor`` keys, a second ``fit``, manual optimization with ``clip_gradients``, gradient
accumulation with clipping; weight-averaging callbacks are refused before training."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from conftest import (
    LossRecorder,
    LRRecorder,
    UserLM,
    assert_same_training,
    fit_module,
    quiet_trainer,
    tiny_model,
    token_batches,
    user_fit,
)
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    EMAWeightAveraging,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelPruning,
    StochasticWeightAveraging,
)
from lightning.pytorch.loggers import Logger
from torch.optim import lr_scheduler as sched

from megatrain_lightning import CPUAdamW, MegaTrainStrategy

STEPS = 6


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model("llama")  # called the default way: use_cache stays on


# -- LR schedulers: the ones holding their own reference to the param groups included --


def _two_groups(module: L.LightningModule, lr: float, cls: type = torch.optim.AdamW) -> torch.optim.Optimizer:
    decay = [p for n, p in module.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in module.named_parameters() if p.ndim < 2]
    return cls([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr)


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "sequential": lambda opt: sched.SequentialLR(
        opt,
        [sched.LinearLR(opt, start_factor=0.1, total_iters=2), sched.CosineAnnealingLR(opt, T_max=4)],
        milestones=[2],
    ),
    "chained": lambda opt: sched.ChainedScheduler(
        [sched.LinearLR(opt, start_factor=0.2, total_iters=3), sched.ExponentialLR(opt, gamma=0.6)]
    ),
    "one_cycle_momentum": lambda opt: sched.OneCycleLR(
        opt, max_lr=1e-2, total_steps=STEPS, cycle_momentum=True, base_momentum=0.8, max_momentum=0.95
    ),
    "cyclic": lambda opt: sched.CyclicLR(
        opt, base_lr=1e-4, max_lr=1e-2, step_size_up=2, cycle_momentum=False
    ),
    "cyclic_momentum": lambda opt: sched.CyclicLR(
        opt, base_lr=1e-4, max_lr=1e-2, step_size_up=2, base_momentum=0.8, max_momentum=0.9
    ),
    "lambda": lambda opt: sched.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
    "cosine": lambda opt: sched.CosineAnnealingLR(opt, T_max=3),
    "plateau": lambda opt: sched.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=0),
}


class ScheduledLM(UserLM):
    scheduler = "sequential"

    def configure_optimizers(self) -> Any:
        optimizer = _two_groups(self, self.lr)
        config = {"scheduler": SCHEDULERS[self.scheduler](optimizer), "interval": "step"}
        if self.scheduler == "plateau":
            config["monitor"] = "train_loss"  # falls every step: "max" mode halves the lr each step
        return {"optimizer": optimizer, "lr_scheduler": config}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_every_lr_scheduler_steers_the_cpu_optimizer(model, name):
    module_cls = type(f"Scheduled_{name}", (ScheduledLM,), {"scheduler": name})
    seen = {}
    runs = []
    for strategy in ("auto", MegaTrainStrategy()):
        recorder = LRRecorder()
        runs.append(user_fit(model, strategy, steps=STEPS, module_cls=module_cls, callbacks=[recorder]))
        seen[strategy if isinstance(strategy, str) else "megatrain"] = recorder.seen
    assert len({lr for lr, _ in seen["auto"]}) > 2, "the schedule must change the learning rate"
    if name.endswith("momentum"):
        assert len({betas for _, betas in seen["auto"]}) > 2, "the schedule must cycle beta1"
    assert seen["megatrain"] == seen["auto"]
    assert_same_training(*runs)


class TensorHparamsLM(UserLM):
    """``lr`` and betas as tensors (torch's AdamW then computes its step size and bias corrections in fp32),
    the lr tensor changed in place by a scheduler."""

    def configure_optimizers(self) -> Any:
        betas = (torch.tensor(0.9), torch.tensor(0.999))
        optimizer = torch.optim.AdamW(self.parameters(), lr=torch.tensor(self.lr), betas=betas)
        scheduler = sched.LinearLR(optimizer, start_factor=0.2, total_iters=3)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_tensor_learning_rate_and_betas_train_bitwise_as_torchs(model):
    """Before, they were read as Python floats (double arithmetic): weights 1.2e-7 apart after 4 steps."""
    plain, paged = (
        user_fit(model, s, steps=STEPS, module_cls=TensorHparamsLM) for s in ("auto", MegaTrainStrategy())
    )
    assert_same_training(plain, paged)


def test_the_optimizers_state_dict_is_the_default_strategys_and_its_state_is_in_the_store(model):
    """``optimizer.state_dict()`` after ``fit`` holds the moments and steps, equal to torch's; the
    ``optimizer.state`` mapping is empty (the moments live in megatrain's store)."""
    plain, paged = (user_fit(model, s, steps=STEPS) for s in ("auto", MegaTrainStrategy()))
    (optimizer,), (reference,) = paged.trainer.optimizers, plain.trainer.optimizers
    assert len(optimizer.state) == 0 and len(reference.state) > 0
    got, expected = optimizer.state_dict(), reference.state_dict()
    assert got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        assert state.keys() == got["state"][index].keys()
        assert all(torch.equal(got["state"][index][k], v) for k, v in state.items()), index


class KeepsItsOptimizer(UserLM):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.user_optimizer = super().configure_optimizers()
        return self.user_optimizer


def test_the_cpu_optimizer_shares_the_users_param_groups_and_class_name(model):
    run = user_fit(model, MegaTrainStrategy(), steps=1, module_cls=KeepsItsOptimizer)
    optimizer = run.trainer.optimizers[0]
    assert isinstance(optimizer, CPUAdamW) and type(optimizer).__name__ == "AdamW"
    groups = run.module.user_optimizer.param_groups
    assert len(optimizer.param_groups) == len(groups)
    assert all(ours is theirs for ours, theirs in zip(optimizer.param_groups, groups, strict=True))


# -- LearningRateMonitor: the same keys as under the default strategy --


class KeysLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.keys: set[str] = set()

    @property
    def name(self) -> str:
        return "keys"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.keys.update(metrics)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class MonitoredLM(UserLM):
    optimizer_cls: type = torch.optim.AdamW
    scheduled = True
    named_groups = False

    def configure_optimizers(self) -> Any:
        optimizer = _two_groups(self, self.lr, self.optimizer_cls)
        if self.named_groups:
            for group, name in zip(optimizer.param_groups, ("matrices", "vectors"), strict=True):
                group["name"] = name
        if not self.scheduled:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": sched.StepLR(optimizer, step_size=1)}


@pytest.mark.parametrize(
    ("optimizer_cls", "scheduled", "named_groups"),
    [(torch.optim.AdamW, True, False), (torch.optim.Adam, False, False), (torch.optim.AdamW, True, True)],
)
def test_learning_rate_monitor_keys_are_the_default_strategys(model, optimizer_cls, scheduled, named_groups):
    module_cls = type(
        "Monitored",
        (MonitoredLM,),
        {"optimizer_cls": optimizer_cls, "scheduled": scheduled, "named_groups": named_groups},
    )
    keys = []
    for strategy in ("auto", MegaTrainStrategy()):
        logger = KeysLogger()
        monitor = LearningRateMonitor(logging_interval="step", log_momentum=True, log_weight_decay=True)
        user_fit(
            model,
            strategy,
            steps=2,
            module_cls=module_cls,
            callbacks=[monitor],
            logger=logger,
            log_every_n_steps=1,
        )
        keys.append({k for k in logger.keys if k.startswith(("lr-", "momentum", "weight_decay"))})
    assert f"lr-{optimizer_cls.__name__}/{'matrices' if named_groups else 'pg1'}" in keys[0]
    assert keys[1] == keys[0]


# -- a second fit on the same module: a fresh optimizer, as torch's AdamW starts with no state --


@pytest.mark.parametrize("same_trainer", [False, True])
def test_second_fit_starts_a_fresh_optimizer_like_the_default_strategy(model, same_trainer):
    runs = []
    for strategy in ("auto", MegaTrainStrategy()):
        module = UserLM(copy.deepcopy(model))
        first = fit_module(module, strategy, steps=3)
        if same_trainer:
            first.trainer.fit_loop.epoch_loop.max_steps = 6
            second = fit_module(module, trainer=first.trainer, steps=3, seed=1)
        else:
            second = fit_module(
                module, strategy if isinstance(strategy, str) else MegaTrainStrategy(), steps=3, seed=1
            )
        assert len(first.losses) == len(second.losses) == 3
        second.losses = first.losses + second.losses
        runs.append(second)
    assert_same_training(*runs)


def test_second_fit_with_compressed_moments_starts_from_zero_moments(model):
    """The quantized moments an earlier fit left in the store are not read by the next optimizer."""
    module = UserLM(copy.deepcopy(model))
    fit_module(module, MegaTrainStrategy(optimizer_compression="int8"), steps=3)
    fresh = UserLM(copy.deepcopy(model))
    fresh.load_state_dict({k: v.clone() for k, v in module.state_dict().items()})
    second = fit_module(module, MegaTrainStrategy(optimizer_compression="int8"), steps=3, seed=1)
    reference = fit_module(fresh, MegaTrainStrategy(optimizer_compression="int8"), steps=3, seed=1)
    assert_same_training(reference, second)


# -- manual optimization: clip_gradients through the LightningOptimizer wrapper --


class ManualClipLM(UserLM):
    """Manual optimization the way the Lightning docs write it, clipping before ``opt.step()``; with
    ``in_closure`` the backward and the clipping run inside ``opt.step(closure)``."""

    clip: tuple[str, float] | None = ("norm", 0.5)
    in_closure = False
    every = 1  # step every ``every`` batches (manual gradient accumulation)

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        losses = []

        def closure() -> torch.Tensor:
            loss = self(batch).loss
            self.manual_backward(loss / self.every)
            if self.clip is not None and (batch_idx + 1) % self.every == 0:
                self.clip_gradients(opt, gradient_clip_val=self.clip[1], gradient_clip_algorithm=self.clip[0])
            losses.append(loss.detach())
            return loss

        if self.in_closure:
            opt.step(closure=closure)
            opt.zero_grad()
        else:
            closure()
            if (batch_idx + 1) % self.every == 0:
                opt.step()
                opt.zero_grad()
        self.log("train_loss", losses[0])
        return losses[0]


@pytest.mark.parametrize(
    ("clip", "in_closure", "every"),
    [
        (("norm", 0.5), False, 1),
        (("value", 2e-3), False, 1),
        (("norm", 0.5), True, 1),
        (("value", 2e-3), False, 2),
    ],
)
def test_manual_optimization_clip_gradients(model, clip, in_closure, every):
    attrs = {"clip": clip, "in_closure": in_closure, "every": every}
    module_cls = type("ManualClip", (ManualClipLM,), attrs)
    unclipped_cls = type("Manual", (ManualClipLM,), attrs | {"clip": None})
    plain = user_fit(model, "auto", module_cls=module_cls)
    paged = user_fit(model, MegaTrainStrategy(), module_cls=module_cls)
    assert_same_training(plain, paged)
    unclipped = user_fit(model, "auto", module_cls=unclipped_cls)
    diff = max(
        (a - b).abs().max().item()
        for a, b in zip(plain.state_dict().values(), unclipped.state_dict().values(), strict=True)
    )
    assert diff > 1e-4, "the clipping must change the result"


@pytest.mark.parametrize(
    ("accumulation", "clip"),
    [("scheduler", ("norm", 0.5)), ("scheduler", ("value", 2e-3)), ("trainer", ("value", 2e-3))],
)
def test_gradient_accumulation_with_clipping(model, accumulation, clip):
    """``GradientAccumulationScheduler`` (1 batch per step, then 2 from the second epoch) or
    ``accumulate_grad_batches=2``, with the Trainer's clipping."""
    kwargs = dict(
        steps=4, max_steps=-1, max_epochs=2, gradient_clip_algorithm=clip[0], gradient_clip_val=clip[1]
    )
    if accumulation == "scheduler":
        kwargs["callbacks"] = [GradientAccumulationScheduler({1: 2})]
    else:
        kwargs["accumulate_grad_batches"] = 2
    runs = [user_fit(model, strategy, **kwargs) for strategy in ("auto", MegaTrainStrategy())]
    assert runs[0].trainer.global_step == (4 + 2 if accumulation == "scheduler" else 8)
    assert_same_training(*runs)


def test_lr_find_matches_and_restores_the_weights(model, tmp_path):
    """``Tuner.lr_find`` (its own exponential schedule on the user's optimizer, then a restore)."""
    from lightning.pytorch.tuner import Tuner

    found, weights = [], []
    for name, strategy in (("plain", "auto"), ("megatrain", MegaTrainStrategy())):
        module = UserLM(copy.deepcopy(model))
        trainer = quiet_trainer(strategy, -1, [], default_root_dir=tmp_path / name)
        batches = torch.utils.data.DataLoader(token_batches(8), batch_size=None)
        torch.manual_seed(1)
        finder = Tuner(trainer).lr_find(module, train_dataloaders=batches, num_training=6, update_attr=False)
        found.append(finder.results)
        weights.append(module.state_dict())
    assert found[1] == found[0]
    assert len(set(found[0]["loss"])) == 6
    initial = UserLM(copy.deepcopy(model)).state_dict()
    for name, value in initial.items():
        assert torch.equal(weights[0][name], value) and torch.equal(weights[1][name], value), name


# -- weight averaging and pruning: refused before training --


@pytest.mark.parametrize(
    "callback",
    [
        lambda: StochasticWeightAveraging(swa_lrs=1e-2),
        lambda: EMAWeightAveraging(),
        lambda: ModelPruning("l1_unstructured", amount=0.2),
    ],
    ids=["swa", "ema", "pruning"],
)
def test_weight_averaging_and_pruning_callbacks_are_refused_before_training(model, callback):
    callback, recorder = callback(), LossRecorder()
    with pytest.raises(MisconfigurationException, match=f"does not support `{type(callback).__name__}`"):
        user_fit(model, MegaTrainStrategy(), callbacks=[callback, recorder])
    assert recorder.losses == []


class UnfreezeLastLayer(BaseFinetuning):
    """Lightning's fine-tuning callback: the last decoder layer frozen, unfrozen as a new param group."""

    def freeze_before_training(self, pl_module) -> None:
        self.freeze(pl_module.model.model.layers[-1])

    def finetune_function(self, pl_module, current_epoch, optimizer) -> None:
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.model.model.layers[-1], optimizer, lr=1e-3)


class FrozenAtStartLM(UserLM):
    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=self.lr, betas=(0.8, 0.9), weight_decay=0.0)


def test_base_finetuning_unfreezes_into_a_new_param_group():
    """The new group takes the user's AdamW defaults (betas, weight decay, the single-tensor kernel), as
    in torch: bitwise."""
    model = tiny_model("llama")
    kwargs = dict(module_cls=FrozenAtStartLM, steps=6, max_epochs=2, limit_train_batches=3)
    plain = user_fit(model, "auto", callbacks=[UnfreezeLastLayer()], **kwargs)
    paged = user_fit(model, MegaTrainStrategy(), callbacks=[UnfreezeLastLayer()], **kwargs)
    assert_same_training(plain, paged)


class ForeignTensorLM(UserLM):
    def configure_optimizers(self):
        extra = torch.nn.Parameter(torch.zeros(3))
        return torch.optim.AdamW([*self.parameters(), extra], lr=self.lr)


def test_an_optimizer_over_tensors_outside_the_module_is_refused_before_training():
    with pytest.raises(MisconfigurationException, match="not a parameter of the LightningModule"):
        user_fit(tiny_model("llama"), MegaTrainStrategy(), module_cls=ForeignTensorLM)
