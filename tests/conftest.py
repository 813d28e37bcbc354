"""Shared helpers: tiny models trained side by side under plain Lightning and megatrain."""

from __future__ import annotations

import copy
import logging
import textwrap
import warnings
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_lightning.data import TextDataModule
from megatrain_lightning.models import CausalLMModule
from megatrain_lightning.presets import tiny_config


@pytest.fixture(autouse=True)
def _quiet() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LitLogger.*")


def tiny_model(arch: str = "llama", seed: int = 0, **overrides: Any) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **overrides))


class LossRecorder(L.Callback):
    """Every micro-batch's training loss, as the training step returned it."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


class LRRecorder(L.Callback):
    """The learning rate and betas of the first param group at every optimizer step."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, tuple[float, float]]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        group = optimizer.param_groups[0]
        self.seen.append((group["lr"], tuple(group["betas"])))


@dataclass
class Run:
    module: L.LightningModule
    trainer: L.Trainer
    losses: list[float] = field(default_factory=list)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The module's weights (for megatrain: read from the store by its state_dict hooks)."""
        return self.module.state_dict()


def quiet_trainer(strategy: Any, steps: int, callbacks: list[L.Callback], **overrides: Any) -> L.Trainer:
    """A Trainer on the CPU for ``steps`` optimizer steps, without logger, checkpoints, progress bar,
    model summary or validation unless ``overrides`` say otherwise."""
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    return L.Trainer(strategy=strategy, callbacks=callbacks, **(kwargs | overrides))


def fit(
    model: torch.nn.Module,
    strategy: Any = "auto",
    steps: int = 20,
    seq_len: int = 32,
    batch_size: int = 2,
    lr: float = 3e-3,
    ckpt_path: Any = None,
    **trainer_kwargs: Any,
) -> Run:
    """Train a copy of ``model`` on the shipped corpus: two param groups, warmup + cosine schedule (from
    ``ckpt_path``'s step when given)."""
    module = CausalLMModule(copy.deepcopy(model), lr=lr, warmup_steps=2, max_steps=steps)
    recorder = LossRecorder()
    trainer = quiet_trainer(strategy, steps, [recorder], **trainer_kwargs)
    torch.manual_seed(1)
    trainer.fit(
        module, datamodule=TextDataModule(seq_len=seq_len, batch_size=batch_size), ckpt_path=ckpt_path
    )
    return Run(module, trainer, recorder.losses)


class UserLM(L.LightningModule):
    """A LightningModule written the way users write one (the parity oracle): the model's default call
    (no ``use_cache=False``), plain tensor or dict batches, ``torch.optim.AdamW`` over ``self.parameters()``."""

    def __init__(self, model: torch.nn.Module, lr: float = 3e-3) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def forward(self, batch: Any) -> Any:
        if isinstance(batch, dict):
            return self.model(**batch)
        return self.model(input_ids=batch, labels=batch)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self(batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self(batch).loss)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self(batch).loss)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch).logits

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def token_batches(
    n: int, batch_size: int = 2, seq_len: int = 16, vocab: int = 256, dicts: bool = False, seed: int = 0
) -> list[Any]:
    """``n`` random batches: token tensors, or dicts with right padding (``attention_mask`` 0 and
    ``labels`` -100 on the padded tail of every other row)."""
    generator = torch.Generator().manual_seed(seed)
    batches: list[Any] = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=generator)
        if not dicts:
            batches.append(ids)
            continue
        mask = torch.ones_like(ids)
        mask[1::2, seq_len - seq_len // 4 :] = 0
        labels = ids.masked_fill(mask == 0, -100)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return batches


def user_fit(
    model: torch.nn.Module,
    strategy: Any = "auto",
    steps: int = 4,
    dicts: bool = False,
    vocab: int = 256,
    seq_len: int = 16,
    module_cls: type[L.LightningModule] = UserLM,
    callbacks: list[L.Callback] | None = None,
    batches: list[Any] | None = None,
    **trainer_kwargs: Any,
) -> Run:
    """Train a copy of ``model`` inside a :class:`UserLM` (or ``module_cls``) for ``steps`` micro-batches
    (``batches``, or random tokens)."""
    module = module_cls(copy.deepcopy(model))
    recorder = LossRecorder()
    trainer = quiet_trainer(strategy, steps, [recorder, *(callbacks or [])], **trainer_kwargs)
    if batches is None:
        micro_batches = steps * trainer_kwargs.get("accumulate_grad_batches", 1)
        batches = token_batches(micro_batches, vocab=vocab, seq_len=seq_len, dicts=dicts)
    torch.manual_seed(1)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    return Run(module, trainer, recorder.losses)


def run_pass(pager: Any, order: list[int]) -> list[float]:
    """One training pass of ``pager`` over blocks ``order``: each block's first weight as its slot shows it."""
    pager.begin_pass("train")
    seen = []
    for block in order:
        seen.append(pager.view(block, 0, pager.acquire(block, backward=False))[0, 0].item())
        pager.release(block)
    return seen


def resident_at_replay(pager: Any, order: list[int]) -> set[int]:
    """Record a pass over ``order``, empty the pager's cache, then start the replay: the blocks resident (or
    loading) once its first block is acquired, i.e. what the prefetch fetched ahead."""
    run_pass(pager, order)
    for slot in pager._slots:  # empty the cache so the replay must fetch everything again
        slot.block = None
    pager._resident.clear()
    pager.begin_pass("train")
    pager.acquire(order[0], backward=False)
    resident = set(pager._resident)
    pager.release(order[0])
    return resident


def assert_same_training(plain: Run, paged: Run, loss_rtol: float = 0.0, param_atol: float = 0.0) -> None:
    """Every micro-batch's loss and every weight the same, bitwise unless a tolerance is given (data
    parallel's sums over the ranks, a rounding the README states)."""
    assert len(plain.losses) == len(paged.losses) > 0
    for step, (a, b) in enumerate(zip(plain.losses, paged.losses, strict=True)):
        assert abs(a - b) <= loss_rtol * abs(a), f"micro-batch {step}: loss {b} vs plain {a}"
    expected, actual = plain.state_dict(), paged.state_dict()
    assert expected.keys() == actual.keys()
    for name, value in expected.items():
        got = actual[name]
        assert got.dtype == value.dtype and got.device.type == "cpu", name
        diff = (got - value).abs().max().item()
        assert diff <= param_atol, f"{name}: max abs diff {diff}"


_PEAK_RSS_WATCHER = """
import psutil, threading, time
process = psutil.Process()
peak = {"rss": 0}
def watch():
    while True:
        peak["rss"] = max(peak["rss"], process.memory_info().rss)
        time.sleep(0.005)
threading.Thread(target=watch, daemon=True).start()
time.sleep(0.05)
baseline = peak["rss"]
"""


def peak_rss_script(body: str) -> str:
    """A subprocess script whose ``PEAK_RSS_WATCHER`` line becomes a thread tracking peak RSS in
    ``peak["rss"]``, with ``baseline`` the RSS before the measured work."""
    return textwrap.dedent(body).replace("PEAK_RSS_WATCHER", _PEAK_RSS_WATCHER.strip())


def fit_module(
    module: L.LightningModule,
    strategy: Any = "auto",
    steps: int = 4,
    trainer: L.Trainer | None = None,
    callbacks: list[L.Callback] | None = None,
    seed: int = 0,
    **trainer_kwargs: Any,
) -> Run:
    """Fit ``module`` itself (no copy) on ``steps`` token batches, with a new Trainer or ``trainer``; the
    losses of this fit are in the returned run (for a second ``fit`` on the same module)."""
    recorder = LossRecorder()
    if trainer is None:
        trainer = quiet_trainer(strategy, steps, [*(callbacks or [])], **trainer_kwargs)
    trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, LossRecorder)] + [recorder]
    batches = token_batches(steps, seed=seed)
    torch.manual_seed(1)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    return Run(module, trainer, recorder.losses)
