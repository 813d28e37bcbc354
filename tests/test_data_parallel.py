"""Data parallel (issue 16): ``devices=2`` on the CPU (gloo, two forked ranks) trains as one rank with the
doubled batch, each rank holding half of the store; a failing rank stops the run with its error."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import LossRecorder, Run, UserLM, assert_same_training, quiet_trainer, tiny_model
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from megatrain_lightning import MegaTrainStrategy, export_hf
from megatrain_lightning.engine.blocks import discover_blocks
from megatrain_lightning.engine.chaos import enabled
from megatrain_lightning.engine.distributed import Shard
from megatrain_lightning.engine.runtime import EngineConfig
from megatrain_lightning.optim.adamw import CPUAdamW
from megatrain_lightning.optim.state_dict import block_state
from megatrain_lightning.ranks import backend_for
from megatrain_lightning.serialization.checkpoint import optimizer_block
from megatrain_lightning.serialization.checkpoint_dir import CheckpointDir, CheckpointError
from megatrain_lightning.serialization.publish import CheckpointWriter
from megatrain_lightning.serialization.single_file import to_lightning

BATCH = 2  # per rank; the single-rank reference trains on 2 * BATCH rows per micro-batch
# Two ranks' half-batch gradients summed are not bitwise the whole batch's, and Adam's first steps turn
# that rounding into weight differences proportional to the learning rate (where a gradient is about as
# small as ``eps``): at 3e-3 plain Lightning itself, fed the same rows as two accumulated half batches,
# ends 1.4e-5 away from the whole batches. At this rate that noise stays well under the 1e-6 compared.
LR = 1e-4
# Two ranks sum a block's gradient over the ranks, in another order than one rank sums its batch: within
# a rounding (the README's "within 1e-6").
AS_ONE_RANK = dict(loss_rtol=1e-6, param_atol=1e-6)
EPS = 1e-3


@pytest.fixture(autouse=True)
def _fresh_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """A free port per test; the launcher's ``MASTER_PORT`` in this process goes with the test."""
    monkeypatch.setenv("MASTER_PORT", str(find_free_network_port()))


class SyncedLM(UserLM):
    """Also logs the loss averaged over ranks (``sync_dist``), which the launcher brings back to this process.
    Adam with a large ``eps`` follows the gradients' scale (with the default it hardly does), so that the
    mean over ranks is checked, not only the direction."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("synced_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, eps=EPS)


class ManualLM(SyncedLM):
    """Manual optimization: the backward runs before the optimizer's step, and the module clips itself and
    reads a gradient (on two ranks: the mean over them, gathered)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False
        self.grad_norms: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        self.grad_norms.append(float(self.model.model.layers[0].mlp.down_proj.weight.grad.norm()))
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        optimizer.step()
        optimizer.zero_grad()
        return loss


class ScaledGradLM(SyncedLM):
    """Scales the gradients in place before the step, as users' hooks do: on two ranks, the mean's copy."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(0.25)


class SometimesLM(SyncedLM):
    """A layer only the first micro-batch of each accumulation window uses: its sums, kept on each rank
    while accumulating, are reduced at the step without a gradient of the stepping micro-batch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sometimes = torch.nn.Linear(4, 1)
        torch.nn.init.constant_(self.sometimes.weight, 0.1)  # the same in every module built
        torch.nn.init.zeros_(self.sometimes.bias)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if batch_idx % 2 == 0:
            loss = loss + self.sometimes(batch[:, :4].float() / 256).mean()
        return loss


class KilledInEpoch2(SyncedLM):
    """Rank 1 is killed in the second epoch (the first one's checkpoint is written)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1 and self.current_epoch == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)


class FailingLM(UserLM):
    """Rank 1 raises, or is killed, in its second micro-batch."""

    kill = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1 and batch_idx == 1:
            if self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("rank 1 failed on purpose")
        return super().training_step(batch, batch_idx)


class KilledLM(FailingLM):
    kill = True


class WeightNormLM(SyncedLM):
    """Logs a weight's norm each step, as users do, with autograd on (Lightning runs hooks so)."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.log("head_norm", self.model.lm_head.weight.norm())


class L2PenaltyLM(UserLM):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) + 1e-2 * self.model.lm_head.weight.pow(2).sum()


class RankProbe(L.Callback):
    """In every rank: the loss averaged over ranks per micro-batch and what the rank saw, saved to ``out``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.losses: list[float] = []
        self.traffic = [0, 0]  # bytes gathered and reduce-scattered in training micro-batches

    def _moved(self, trainer) -> list[int]:
        return [trainer.strategy.stats.gathered_bytes, trainer.strategy.stats.reduce_scattered_bytes]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.traffic = [t - now for t, now in zip(self.traffic, self._moved(trainer), strict=True)]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.traffic = [t + now for t, now in zip(self.traffic, self._moved(trainer), strict=True)]
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

    def on_train_end(self, trainer, pl_module) -> None:
        store = trainer.strategy.engine.store
        report = {
            "losses": self.losses,
            "world_size": trainer.world_size,
            "global_rank": trainer.global_rank,
            "sampler": type(trainer.train_dataloader.sampler).__name__,
            "store_bytes": store.nbytes(),
            "store_dir": getattr(store, "directory", None),
            "shard_bytes": sum(store.layout(b, "param")[1] * 4 for b in range(len(store.blocks))),
            "traffic": self.traffic,
            "gathers_ahead": trainer.strategy.stats.gathers_ahead,
            "versions": [store.version(b) for b in range(len(store.blocks))],  # the same on every rank
            "accesses": len(trainer.strategy.engine.pager.trace.state_dict()["train"]),  # of a training pass
            "grad_norms": getattr(pl_module, "grad_norms", None),
            "optimizer_blocks": _optimizer_blocks(trainer),  # gathered from every rank's share
        }
        torch.save(report, self.out / f"rank{trainer.global_rank}.pt")


def _optimizer_blocks(trainer: L.Trainer) -> list[dict[str, torch.Tensor]]:
    """A copy of every block's optimizer state as the store holds it (compressed where it is)."""
    optimizer = trainer.strategy.engine.optimizer
    blocks = [block_state(optimizer, b) for b in range(len(optimizer.store.blocks))]
    return [{kind: state.clone() for kind, state in block.items()} for block in blocks]


class OptimizerProbe(L.Callback):
    """The optimizer state a run starts from (after a checkpoint was loaded)."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.blocks = _optimizer_blocks(trainer)


def _two_ranks(**options: Any) -> MegaTrainStrategy:
    """Forked ranks (unless ``options`` say another start method); a collective that waits over a minute
    fails (a test's bug would hang for 30)."""
    return MegaTrainStrategy(**(dict(start_method="fork", timeout=timedelta(minutes=1)) | options))


def _rows(micro_batches: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return list(torch.randint(0, 256, (micro_batches * 2 * BATCH, 16), generator=generator))


def _order(n: int, epoch: int) -> list[int]:
    """The permutation Lightning's ``DistributedSampler`` deals the rows of ``epoch`` from (seeded by
    ``PL_GLOBAL_SEED``, one more per epoch); rank ``r`` takes every other row from ``r`` on."""
    seed = int(os.getenv("PL_GLOBAL_SEED", 0)) + epoch
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def _plain_fit(
    model: torch.nn.Module,
    steps: int,
    module_cls: type[UserLM] = SyncedLM,
    strategy: Any = "auto",
    **trainer_kwargs: Any,
) -> Run:
    """The reference: plain Lightning (or ``strategy``), one process, ``2 * BATCH`` rows per micro-batch:
    those the two ranks see together (Lightning's ``DistributedSampler`` shuffles training data: in
    :func:`_order`)."""
    module, recorder = module_cls(copy.deepcopy(model), lr=LR), LossRecorder()
    trainer = quiet_trainer(strategy, steps, [recorder], **trainer_kwargs)
    rows = _rows(steps * trainer_kwargs.get("accumulate_grad_batches", 1))
    torch.manual_seed(1)
    ordered = [rows[i] for i in _order(len(rows), 0)]
    trainer.fit(module, train_dataloaders=DataLoader(ordered, batch_size=2 * BATCH))
    return Run(module, trainer, recorder.losses)


def _dp_fit(
    model: torch.nn.Module,
    out: Path,
    steps: int,
    module_cls: type[UserLM] = SyncedLM,
    validate: bool = False,
    strategy_kwargs: dict[str, Any] | None = None,
    save_to: Path | None = None,
    **trainer_kwargs: Any,
) -> tuple[Run, list[dict[str, Any]]]:
    """megatrain on two forked ranks, ``BATCH`` rows each (Lightning's ``DistributedSampler`` splits them),
    checkpointing into ``save_to`` if given. The launcher loads rank 0's final weights into this process's
    module."""
    module = module_cls(copy.deepcopy(model), lr=LR)
    strategy = _two_ranks(**(strategy_kwargs or {}))
    callbacks: list[L.Callback] = [RankProbe(out)]
    if save_to is not None:
        callbacks.append(ModelCheckpoint(dirpath=save_to, save_last=True))
    trainer = quiet_trainer(
        strategy, steps, callbacks, devices=2, enable_checkpointing=save_to is not None, **trainer_kwargs
    )
    rows = _rows(steps * trainer_kwargs.get("accumulate_grad_batches", 1))
    torch.manual_seed(1)
    val = DataLoader(_rows(1), batch_size=BATCH) if validate else None
    trainer.fit(module, train_dataloaders=DataLoader(rows, batch_size=BATCH), val_dataloaders=val)
    reports = [torch.load(out / f"rank{rank}.pt") for rank in range(2)]
    return Run(module, trainer, reports[0]["losses"]), reports


@pytest.mark.parametrize(
    ("arch", "steps", "module_cls", "options"),
    [
        # Clipping that fires scales every step's gradients to one norm: this case checks their scale.
        ("llama", 2, SyncedLM, dict(accumulate_grad_batches=2)),
        ("gpt2", 3, SyncedLM, dict(gradient_clip_val=0.5)),  # tied embeddings and head
        ("llama", 2, ManualLM, {}),
        ("mixtral", 2, SyncedLM, dict(gradient_clip_val=0.5, accumulate_grad_batches=2)),  # experts
        ("llama", 2, SometimesLM, dict(accumulate_grad_batches=2)),
        ("llama", 2, ScaledGradLM, dict(gradient_clip_val=0.01)),  # the clipping norm sees the scaling
        ("llama", 2, WeightNormLM, {}),  # a weight read with autograd on, no gradient from it
    ],
    ids=[
        "llama-accumulate",
        "gpt2-clip",
        "llama-manual-clip",
        "moe-clip-accumulate",
        "llama-sometimes",
        "llama-grads-scaled-clip",
        "llama-weight-norm-logged",
    ],
)
def test_two_ranks_train_as_one_with_the_doubled_batch(
    arch: str, steps: int, module_cls: type[UserLM], options: dict[str, Any], tmp_path: Path
) -> None:
    model = tiny_model(arch)
    plain = _plain_fit(model, steps, module_cls, **options)
    paged, reports = _dp_fit(model, tmp_path, steps, module_cls, **options)
    assert_same_training(plain, paged, **AS_ONE_RANK)
    assert [(r["world_size"], r["global_rank"], r["sampler"]) for r in reports] == [
        (2, 0, "DistributedSampler"),
        (2, 1, "DistributedSampler"),
    ]
    assert reports[0]["losses"] == reports[1]["losses"]  # reduced over the ranks
    if module_cls is ManualLM:
        assert reports[0]["grad_norms"] == pytest.approx(plain.module.grad_norms, rel=1e-6)
    synced = float(paged.trainer.callback_metrics["synced_loss"])
    accumulate = options.get("accumulate_grad_batches", 1)
    assert synced == pytest.approx(paged.losses[-1] * accumulate, rel=1e-6)  # outputs' loss is divided


def test_ranks_started_by_spawn_train_as_forked_ones(tmp_path: Path) -> None:
    """``start_method="spawn"`` (``ddp_spawn``'s launcher) pickles the trainer, and the strategy with it,
    into each rank: nothing the strategy holds before training may be a lambda."""
    model = tiny_model("llama")
    plain = _plain_fit(model, 2)
    paged, _ = _dp_fit(model, tmp_path, 2, strategy_kwargs=dict(start_method="spawn"))
    assert_same_training(plain, paged, **AS_ONE_RANK)


def test_two_ranks_route_the_router_logits_out_of_the_gathered_blocks(tmp_path: Path) -> None:
    """A mixture of experts' router logits, collected inside the layers, leave each gathered block through
    its call on every rank. Their load-balancing loss is weighted 0 here: each rank takes it over its half
    batch, a statistic that is not linear in the batch (as under DDP), so only then is it one rank's."""
    model = tiny_model("mixtral", output_router_logits=True, router_aux_loss_coef=0.0)
    plain = _plain_fit(model, 2, accumulate_grad_batches=2)
    paged, _ = _dp_fit(model, tmp_path, 2, accumulate_grad_batches=2)
    assert_same_training(plain, paged, **AS_ONE_RANK)


def test_two_ranks_in_bf16_mixed_train_as_one_within_its_rounding(tmp_path: Path) -> None:
    """Under bf16-mixed the blocks are gathered in the slot's dtypes. One rank's megatrain is bitwise plain
    Lightning's; two ranks differ from it by bf16 rounding only (autocast rounds each half batch's weight
    gradient products to bf16, where one rank rounds the whole batch's): about 1e-5 here, 5e-5 allowed."""
    model = tiny_model("llama")
    plain = _plain_fit(model, 3, precision="bf16-mixed")
    paged, _ = _dp_fit(model, tmp_path, 3, precision="bf16-mixed")
    assert_same_training(plain, paged, loss_rtol=5e-5, param_atol=5e-5)


def test_the_disk_tier_keeps_each_ranks_shard_in_a_folder_of_its_own(tmp_path: Path) -> None:
    """... and each rank saves its share from there: the checkpoint is the trained model, bitwise."""
    model, offload = tiny_model("llama"), tmp_path / "offload"
    options = dict(gradient_clip_val=0.5, accumulate_grad_batches=2)
    plain = _plain_fit(model, 2, **options)
    paged, reports = _dp_fit(
        model, tmp_path, 2, strategy_kwargs=dict(offload_dir=offload), save_to=tmp_path / "ckpts", **options
    )
    assert_same_training(plain, paged, **AS_ONE_RANK)
    saved = to_lightning(tmp_path / "ckpts" / "last.ckpt")
    assert saved["global_step"] == 2
    assert all(torch.equal(saved["state_dict"][name], value) for name, value in paged.state_dict().items())
    moments = saved["optimizer_states"][0]["state"]  # each rank's pieces of every block's m and v, as one
    assert [moments[i]["exp_avg"].shape for i in sorted(moments)] == [
        p.shape for p in paged.module.parameters()
    ]
    assert [r["store_dir"] for r in reports] == [
        str(offload / f"rank{r}" / "megatrain_store") for r in (0, 1)
    ]
    assert not offload.exists()  # made for the run, removed with its stores


def _epoch_fit(
    model: torch.nn.Module,
    out: Path,
    devices: int,
    epochs: int,
    ckpt_path: Path | None = None,
    save_to: Path | None = None,
    module_cls: type[UserLM] = SyncedLM,
) -> Run:
    """Epochs of two micro-batches of ``2 * BATCH`` rows: on two ranks (each ``BATCH``), or on one rank
    with the rows in the order the ranks take them together (:func:`_order`, for the last epoch)."""
    rows = _rows(2)
    callbacks: list[L.Callback] = [RankProbe(out)]
    if save_to is not None:
        callbacks.append(ModelCheckpoint(dirpath=save_to, save_last=True))
    if devices == 2:
        strategy, loader = _two_ranks(), DataLoader(rows, batch_size=BATCH)
    else:
        ordered = [rows[i] for i in _order(len(rows), epochs - 1)]
        strategy, loader = MegaTrainStrategy(), DataLoader(ordered, batch_size=2 * BATCH)
    module = module_cls(copy.deepcopy(model), lr=LR)
    trainer = quiet_trainer(
        strategy, -1, callbacks, devices=devices, max_epochs=epochs, enable_checkpointing=save_to is not None
    )
    torch.manual_seed(1)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    return Run(module, trainer, torch.load(out / "rank0.pt")["losses"])


def test_a_killed_rank_resumes_from_the_checkpoint_exactly_on_two_ranks_and_on_one(tmp_path: Path) -> None:
    """Each rank writes its share of every block. After a rank was killed, two ranks resume from the last
    checkpoint bitwise as the run that was not interrupted; one rank resumes from it as one rank trains
    (and two ranks from one rank's); its export is the model one rank trains."""
    model = tiny_model("llama")
    whole = _epoch_fit(model, tmp_path, 2, epochs=2)
    with pytest.raises(Exception, match="SIGKILL"):
        _epoch_fit(model, tmp_path, 2, epochs=2, save_to=tmp_path / "two", module_cls=KilledInEpoch2)
    saved = CheckpointDir.verify(tmp_path / "two" / "last.ckpt")
    blocks = len(saved.manifest["blocks"])
    for kind in ("model", "optimizer"):
        assert sorted(name for name in saved.manifest["files"] if name.startswith(f"{kind}/block-")) == [
            f"{kind}/block-{b:05d}-rank-{r:05d}-of-00002.safetensors" for b in range(blocks) for r in (0, 1)
        ]
    resumed = _epoch_fit(model, tmp_path, 2, epochs=2, ckpt_path=tmp_path / "two" / "last.ckpt")
    assert resumed.losses == whole.losses[2:]
    # a rank that holds nothing of a small block (the final norm) moves its version on loading as the
    # other does: a gather's staleness is judged alike on every rank
    versions = [torch.load(tmp_path / f"rank{rank}.pt")["versions"] for rank in (0, 1)]
    assert versions[0] == versions[1]
    expected, actual = whole.state_dict(), resumed.state_dict()
    assert all(torch.equal(expected[name], actual[name]) for name in expected)
    on_one = _epoch_fit(model, tmp_path, 1, epochs=2, ckpt_path=tmp_path / "two" / "last.ckpt")
    assert_same_training(Run(whole.module, whole.trainer, whole.losses[2:]), on_one, **AS_ONE_RANK)
    _epoch_fit(model, tmp_path, 1, epochs=1, save_to=tmp_path / "one")
    on_two = _epoch_fit(model, tmp_path, 2, epochs=2, ckpt_path=tmp_path / "one" / "last.ckpt")
    assert_same_training(Run(whole.module, whole.trainer, whole.losses[2:]), on_two, **AS_ONE_RANK)
    export_hf(str(tmp_path / "two" / "last.ckpt"), str(tmp_path / "hf_two"))
    export_hf(str(tmp_path / "one" / "last.ckpt"), str(tmp_path / "hf_one"))
    two, one = (load_file(tmp_path / f"hf_{n}" / "model.safetensors") for n in ("two", "one"))
    assert two.keys() == one.keys() and len(one) == len(model.state_dict())
    assert all((two[name] - one[name]).abs().max() <= 1e-6 for name in one)


class ErrorRecorder(MegaTrainStrategy):
    """Saves what each rank was told when a save or a load failed (``error<rank>.txt``; of a save, also what
    the checkpoint's folder held then, ``left<rank>.txt``); a rank then waits until every rank saved its own
    (the launcher stops the others when a rank ends, and Lightning's SIGTERM handler then fails in a
    collective: whichever rank ends first, no rank's record is cut short). ``chaos``: faults injected into
    rank ``first``'s saves (``MEGATRAIN_CHAOS``'s format)."""

    out: Path
    first = 0
    chaos: str | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, *args: Any, **kwargs: Any) -> None:
        faults = (
            enabled(self.chaos) if self.chaos and self.global_rank == self.first else contextlib.nullcontext()
        )
        with self._recorded(Path(filepath).parent), faults:
            super().save_checkpoint(checkpoint, filepath, *args, **kwargs)

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        with self._recorded():
            return super().load_checkpoint(*args, **kwargs)

    @contextlib.contextmanager
    def _recorded(self, folder: Path | None = None) -> Iterator[None]:
        try:
            yield
        except Exception as err:
            if folder is not None:
                left = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
                (self.out / f"left{self.global_rank}.txt").write_text("\n".join(left))
            (self.out / f"error{self.global_rank}.txt").write_text(f"{type(err).__name__}: {err}")
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not all(
                (self.out / f"error{rank}.txt").exists() for rank in range(self.world_size)
            ):
                time.sleep(0.05)
            raise


def test_the_ranks_divide_the_checksums_and_all_refuse_a_corrupt_checkpoint(tmp_path: Path) -> None:
    """Each rank checks every other file of the checkpoint: a byte changed in a file that rank 1 checks
    stops both ranks before anything is loaded, rank 0 told by rank 1, with the file named. (And a rank's
    file missing from the manifest leaves tensors in pieces that do not make them whole: refused.)"""
    model = tiny_model("llama")
    _epoch_fit(model, tmp_path, 2, epochs=1, save_to=tmp_path / "ckpts")
    ckpt = tmp_path / "ckpts" / "last.ckpt"
    saved = CheckpointDir.verify(ckpt)
    for kind in ("model", "optimizer"):
        files = {
            k: v
            for k, v in saved.manifest["files"].items()
            if not k.startswith(f"{kind}/block-00001-rank-00001")
        }
        incomplete = CheckpointDir(saved.path, {**saved.manifest, "files": files})
        with pytest.raises(CheckpointError, match="do not make the whole tensor"):
            incomplete.weights() if kind == "model" else incomplete.optimizer()
    corrupt = ckpt / sorted(saved.manifest["files"])[1]  # the second: rank 1's
    data = bytearray(corrupt.read_bytes())
    data[-1] ^= 1
    corrupt.write_bytes(bytes(data))
    strategy = ErrorRecorder(start_method="fork", timeout=timedelta(minutes=1))
    strategy.out, strategy.first = tmp_path, 1
    trainer = quiet_trainer(strategy, -1, [], devices=2, max_epochs=2)
    start = time.monotonic()
    with pytest.raises(Exception, match=f"{corrupt.name} does not match its checksum"):
        trainer.fit(
            SyncedLM(copy.deepcopy(model), lr=LR), DataLoader(_rows(2), batch_size=BATCH), ckpt_path=ckpt
        )
    assert time.monotonic() - start < 60
    told = (tmp_path / "error0.txt").read_text()
    assert "rank 1 could not load the checkpoint" in told and f"{corrupt.name} does not match" in told


@pytest.mark.parametrize("failing", [0, 1])
def test_a_save_failing_on_one_rank_fails_on_every_rank_and_publishes_nothing(
    failing: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rank runs out of space: rank 0 after both ranks wrote their blocks' files, or rank 1 at its first
    file. The other rank is told which rank failed and why, within the collective's timeout, and neither
    a checkpoint nor a partial copy stays: no rank's save ends before rank 0 removed the temporary copy
    (slow at it here), or the launcher, stopping the others once a rank ends, would cut the removal short."""
    abandon = CheckpointWriter.abandon
    monkeypatch.setattr(CheckpointWriter, "abandon", lambda writer: (time.sleep(1), abandon(writer)))
    model = tiny_model("llama")
    module = SyncedLM(copy.deepcopy(model), lr=LR)
    blocks = len(discover_blocks(module))  # each rank writes two files per block, then rank 0 the rest
    strategy = ErrorRecorder(start_method="fork", timeout=timedelta(minutes=1))
    strategy.out, strategy.first, save_to = tmp_path, failing, tmp_path / "ckpts"
    strategy.chaos = f"fail=ckpt.write:{2 * blocks + 1 if failing == 0 else 1}:ENOSPC"
    callbacks = [ModelCheckpoint(dirpath=save_to, save_last=True)]
    trainer = quiet_trainer(strategy, 2, callbacks, devices=2, enable_checkpointing=True)
    start = time.monotonic()
    with pytest.raises(Exception, match="No space"):
        trainer.fit(module, train_dataloaders=DataLoader(_rows(2), batch_size=BATCH))
    assert time.monotonic() - start < 60
    own = (tmp_path / f"error{failing}.txt").read_text()
    assert own.startswith("CheckpointIOError: [Errno 28] megatrain: writing")
    told = (tmp_path / f"error{1 - failing}.txt").read_text()
    assert "CheckpointIOError" in told and f"rank {failing} failed" in told and "No space" in told
    assert [(tmp_path / f"left{rank}.txt").read_text() for rank in (0, 1)] == ["", ""]
    assert not save_to.exists() or not any(save_to.iterdir())


# Two ranks' gradients are the whole batch's within rounding, and near a code boundary that rounding picks
# the neighbouring code: with int4's 16 levels that moves a weight by a few percent of one step's update.
@pytest.mark.parametrize(
    ("compression", "param_atol", "tier"),
    [("int8", 1e-6, "host"), ("int4", 1e-5, "host"), ("int8", 1e-6, "disk")],
)
def test_compressed_optimizer_state_is_sharded_and_checkpointed_by_rank_too(
    compression: str, param_atol: float, tier: str, tmp_path: Path
) -> None:
    """Each rank holds and updates its share of the codes and scales too (a share starts on a quantization
    block's boundary): two ranks train as one rank with the same compression and the doubled batch, each
    holding about half of its store; the ranks' checkpoint files hold the state bit for bit, and one
    rank resumes from them with it."""
    model, options = tiny_model("llama"), dict(gradient_clip_val=0.5)
    one = _plain_fit(model, 3, strategy=MegaTrainStrategy(optimizer_compression=compression), **options)
    two, reports = _dp_fit(
        model,
        tmp_path,
        3,
        strategy_kwargs=dict(
            optimizer_compression=compression, offload_dir=tmp_path / "offload" if tier == "disk" else None
        ),
        save_to=tmp_path / "ckpts",
        **options,
    )
    assert_same_training(one, two, loss_rtol=1e-6, param_atol=param_atol)
    whole = one.trainer.strategy.engine.store.nbytes()
    assert all(r["store_bytes"] <= 0.55 * whole for r in reports)
    gathered = reports[0]["optimizer_blocks"]
    assert any("m_codes" in block for block in gathered)
    entries = CheckpointDir.verify(tmp_path / "ckpts" / "last.ckpt").optimizer().entries
    for b, state in enumerate(gathered):
        saved = optimizer_block(entries, b)
        assert saved.keys() == state.keys() and all(torch.equal(saved[k], state[k]) for k in state)
    probe = OptimizerProbe()
    resumed = quiet_trainer(MegaTrainStrategy(optimizer_compression=compression), 4, [probe])
    module = SyncedLM(copy.deepcopy(model), lr=LR)
    resumed.fit(
        module, DataLoader(_rows(4), batch_size=2 * BATCH), ckpt_path=tmp_path / "ckpts" / "last.ckpt"
    )
    for state, loaded in zip(gathered, probe.blocks, strict=True):
        assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_each_rank_holds_half_the_store_and_moves_the_least(tmp_path: Path) -> None:
    """Per micro-batch each block is gathered once for the forward and once for the backward (the recompute
    shares it) and its gradients are reduce-scattered once: each time a rank receives, or sends, the other
    ranks' shards and nothing more. (Validation runs too: its forwards gather as well.)"""
    model = tiny_model("llama")
    module = UserLM(copy.deepcopy(model))
    single = quiet_trainer(MegaTrainStrategy(), 1, [])
    single.fit(module, train_dataloaders=DataLoader(_rows(1), batch_size=2 * BATCH))
    whole = single.strategy.engine.store.nbytes()
    steps = 2
    _, reports = _dp_fit(model, tmp_path, steps, validate=True, limit_val_batches=1)
    for r in reports:
        assert 0 < r["store_bytes"] <= 0.55 * whole, (whole, r)
        others = (2 - 1) * r["shard_bytes"]  # world - 1 shards
        assert r["traffic"] == [2 * steps * others, steps * others]


@pytest.mark.parametrize(
    ("module_cls", "error"),
    [
        (FailingLM, "rank 1 failed on purpose"),
        (KilledLM, "process 1 terminated with signal SIGKILL"),
        (L2PenaltyLM, "a gradient reached it; under data parallel each rank holds only part of it"),
    ],
    ids=["raises", "killed", "weight-penalty"],
)
def test_a_failing_rank_stops_the_run(module_cls: type[UserLM], error: str, tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(Exception, match=error):
        _dp_fit(tiny_model("llama"), tmp_path, 4, module_cls=module_cls)
    assert time.monotonic() - start < 60


def test_a_layer_changing_its_weights_in_its_forward_is_refused_under_data_parallel(tmp_path: Path) -> None:
    """``nn.Embedding(max_norm=...)`` renormalizes the rows its own rank's batch looks up: under DDP the
    replicas would drift apart; megatrain stops with an error that says so, quickly (no rank left waiting)."""
    model = tiny_model("llama")
    model.model.embed_tokens.max_norm = 0.1
    start = time.monotonic()
    with pytest.raises(Exception, match="changes its weights in its forward .* under data parallel"):
        _dp_fit(model, tmp_path, 2)
    assert time.monotonic() - start < 60


def test_a_gradient_read_after_updates_that_end_at_different_times_is_collective_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning's ``zero_grad`` before validation reads every ``p.grad`` (collective under data parallel)
    while updates may still run in the update thread; rank 1's updates finish much later than rank 0's,
    and both ranks still read, or skip, the same gradients (before: rank 0 skipped the gather of a block
    whose update had ended, rank 1 waited in it until the timeout)."""
    run = CPUAdamW._run

    def slow_on_rank_1(self: CPUAdamW, *args: Any) -> None:
        if torch.distributed.get_rank() == 1:
            time.sleep(0.3)
        run(self, *args)

    monkeypatch.setattr(CPUAdamW, "_run", slow_on_rank_1)
    start = time.monotonic()
    _, reports = _dp_fit(
        tiny_model("llama"), tmp_path, 2, validate=True, limit_val_batches=1, val_check_interval=1,
        strategy_kwargs=dict(optimizer_threads=1),
    )  # fmt: skip
    assert reports[0]["losses"] == reports[1]["losses"] and time.monotonic() - start < 50


def _mean_over_ranks(rank: int) -> tuple[torch.dtype, int, float]:
    strategy = MegaTrainStrategy(parallel_devices=[torch.device("cpu")] * 2)
    mean = functools.partial(strategy.reduce, reduce_op="mean")
    whole, real = mean(torch.tensor(2 + rank)), mean(torch.tensor(2.0 + rank))
    return whole.dtype, whole.item(), real.item()  # values: a tensor would outlive its process's memory


def test_a_mean_of_host_tensors_is_taken_in_the_group_that_gpus_use() -> None:
    """With ``cpu:gloo,cuda:nccl`` (the default on GPUs) host tensors go to gloo, which has no average:
    ``sync_dist`` of an integer metric (a logged value's batch count) is summed and divided, as under
    plain gloo (Lightning divides only where the group is plain ``gloo``)."""
    assert _on_two_ranks(_mean_over_ranks, backend="cpu:gloo") == [(torch.int64, 2, 2.5)] * 2


def test_blocks_are_gathered_ahead_along_the_trace_with_the_same_results(tmp_path: Path) -> None:
    """Once a pass has been traced, acquiring a block starts the gather of the next one (every access of a
    pass but its first is gathered ahead), and training is bitwise the run that gathers only on demand."""
    model, steps = tiny_model("gpt2"), 3  # tied embeddings and head: a block used twice in a pass
    for run in ("ahead", "demand"):
        (tmp_path / run).mkdir()
    ahead, reports = _dp_fit(model, tmp_path / "ahead", steps)
    on_demand, demand_reports = _dp_fit(
        model, tmp_path / "demand", steps, strategy_kwargs=dict(prefetch_depth=0)
    )
    assert_same_training(on_demand, ahead, loss_rtol=0.0, param_atol=0.0)
    for report, demand in zip(reports, demand_reports, strict=True):
        assert report["gathers_ahead"] == (steps - 1) * (report["accesses"] - 1) > 0
        assert demand["gathers_ahead"] == 0
        assert report["traffic"] == demand["traffic"]  # nothing gathered twice


def test_gpus_exchange_on_the_device_through_nccl_and_host_tensors_through_gloo() -> None:
    """On CUDA the default group carries NCCL for device tensors and gloo for the host's (the store's
    shards and records), and the ranks gather blocks on their GPU; on the CPU gloo alone."""
    assert backend_for(torch.device("cuda", 0), None) == "cpu:gloo,cuda:nccl"
    assert backend_for(torch.device("cuda", 0), "nccl") == "cpu:gloo,cuda:nccl"
    assert backend_for(torch.device("cpu"), None) == "gloo"
    assert backend_for(torch.device("cuda", 0), "gloo") == "gloo"
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    strategy = MegaTrainStrategy(parallel_devices=devices, cluster_environment=LightningEnvironment())
    strategy._configure_launcher()  # not refused
    strategy.set_world_ranks()
    for backend, exchange in [("cpu:gloo,cuda:nccl", devices[0]), ("gloo", torch.device("cpu"))]:
        strategy._process_group_backend = backend
        config, _ = strategy.rank_engine_config(EngineConfig(device=devices[0]), [])
        assert config.shard == Shard(0, 2, exchange)


def test_data_parallel_without_activation_checkpointing_warns_of_the_memory_it_holds() -> None:
    strategy = MegaTrainStrategy(
        parallel_devices=[torch.device("cpu")] * 2, cluster_environment=LightningEnvironment()
    )
    strategy.set_world_ranks()
    with pytest.warns(UserWarning, match="keeps every gathered block until its backward"):
        strategy.rank_engine_config(EngineConfig(torch.device("cpu"), activation_checkpointing=False), [])


def test_data_parallel_on_other_accelerators_is_refused_before_training() -> None:
    strategy = MegaTrainStrategy(parallel_devices=[torch.device("mps", 0), torch.device("mps", 1)])
    with pytest.raises(
        MisconfigurationException,
        match="on CPUs .gloo. or CUDA GPUs .NCCL.; this run asks for accelerator 'mps'",
    ):
        strategy._configure_launcher()


# A user's script as users launch it: ``python script.py``, the strategy's launcher starting rank 1. Its own
# exit handler, registered before the Trainer's, runs after the strategy's and reports the group.
_REGRESSION = """
import atexit
import os
import signal

import lightning as L
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from torch.utils.data import DataLoader

import megatrain_lightning  # registers strategy="megatrain"


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.linear(x))


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(2))

    def training_step(self, batch, batch_idx):
        for layer in self.layers:
            batch = layer(batch)
        return batch.square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

"""

_EXITING_SCRIPT = (
    _REGRESSION
    + """
@atexit.register
def report():  # one write of a line: the ranks share the pipe
    os.write(1, f"group alive at exit: {torch.distributed.is_initialized()}\\n".encode())


trainer = L.Trainer(
    strategy="megatrain", accelerator="cpu", devices=2, max_steps=2, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(Regression(), DataLoader(torch.randn(16, 8), batch_size=4))
"""
)

_CTRL_C_ON_RANK_1_SCRIPT = (
    _REGRESSION
    + """
class CtrlCOnRank1(Regression):  # Ctrl-C reaches rank 1 alone (kill -INT, a scheduler), in step 2's backward
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and self.global_step == 1:
            loss.register_hook(lambda grad: signal.raise_signal(signal.SIGINT))
        return loss


trainer = L.Trainer(
    strategy="megatrain", accelerator="cpu", devices=2, max_steps=4, logger=False,
    callbacks=[OnExceptionCheckpoint(".")], enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(CtrlCOnRank1(), DataLoader(torch.randn(16, 8), batch_size=4))
"""
)


def _run_script(tmp_path: Path, script: str) -> subprocess.CompletedProcess:
    (tmp_path / "train.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )


def test_each_rank_destroys_its_gloo_group_before_the_interpreter_exits(tmp_path: Path) -> None:
    """Lightning destroys the process group at exit only for NCCL. A gloo group left to the interpreter's
    finalization aborted a rank now and then after its work was done ("terminate called without an active
    exception": 6 of 40 two-rank torchrun runs of a script that exits without destroying its group, 0 of
    40 with it destroyed by an exit handler): the strategy destroys every group it made at exit."""
    proc = _run_script(tmp_path, _EXITING_SCRIPT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("group alive at exit: False") == 2, proc.stdout[-3000:]


def test_ctrl_c_on_one_rank_stops_every_rank_after_the_step_with_a_checkpoint_of_it(tmp_path: Path) -> None:
    """The rank that got it finishes the step as the others do, then every rank stops at the next batch, so
    `OnExceptionCheckpoint` (which needs every rank's share) holds two whole steps. Before, that rank alone
    stopped: its save waited for the others, which waited in the next step's collectives."""
    proc = _run_script(tmp_path, _CTRL_C_ON_RANK_1_SCRIPT)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # Lightning's exit on Ctrl-C
    assert "[rank: 1] megatrain: Ctrl-C: finishing this step first" in proc.stderr
    checkpoint = tmp_path / "on_exception.ckpt"
    assert CheckpointDir.verify(checkpoint).lightning_state()["global_step"] == 2
    assert not list(tmp_path.glob("*.tmp-*"))


def _rank_main(
    rank: int, port: str, backend: str, work: Callable[..., Any], args: tuple[Any, ...], results: Any
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # a forked child must not start the OpenMP pool its parent has running
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        results.put((rank, work(rank, *args)))
        dist.destroy_process_group()
    except Exception as err:  # reported, not lost in the child's stderr
        results.put((rank, repr(err)))


def _on_two_ranks(work: Callable[..., Any], *args: Any, backend: str = "gloo") -> list[Any]:
    """``work(rank, *args)`` in two forked processes joined by a ``backend`` group: what each returned (or
    the error it raised), by rank."""
    import torch.multiprocessing as mp

    context = mp.get_context("fork")
    results = context.Queue()
    port = os.environ["MASTER_PORT"]
    ranks = [
        context.Process(target=_rank_main, args=(rank, port, backend, work, args, results))
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=60)
    return [result for _, result in sorted((results.get(timeout=5) for _ in ranks), key=lambda r: r[0])]


def _sharded_store(rank: int, blocks: list[Any]) -> Any:
    from megatrain_lightning.engine.distributed import Shard, ShardedHostStore
    from megatrain_lightning.telemetry.stats import EngineStats

    return ShardedHostStore(Shard(rank, 2), blocks, EngineStats(), chunk_numel=1 << 20)


def _write_own(store: Any, block: int, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of the whole ``full`` written into its shard of ``block``; returns ``full``."""
    lo, hi = store.shard.owned(store.blocks[block])
    with store.pinned(block, "param", write=True, span=(lo, hi)) as own:
        own.copy_(full[lo:hi])
    return full


def _read_span(rank: int) -> tuple[bool, bool]:
    from megatrain_lightning.store.layout import Block

    block = Block(0, "b", numel=1000)
    store = _sharded_store(rank, [block])
    whole = torch.full((1000,), -0.0)
    whole[::3] = torch.arange(len(whole[::3]), dtype=torch.float32) - 5
    _write_own(store, 0, whole)
    span, read = store.read_span(0, "param", (0, 1000)), store.read(0, "param")
    return torch.equal(span.view(torch.int32), read.view(torch.int32)), bool(torch.signbit(span).any())


def test_a_span_read_across_ranks_is_the_owners_bits() -> None:
    """Checkpoints and ``p.grad`` read spans gathered from the ranks' shards: each element exactly as its
    owner holds it, ``-0.0`` included (a float sum with the other ranks' zeros gives ``+0.0``)."""
    assert _on_two_ranks(_read_span) == [(True, True), (True, True)]


def _write_span(rank: int) -> tuple[bool, bool, bool]:
    from megatrain_lightning.store.layout import Block

    block = Block(0, "b", numel=1000)
    store = _sharded_store(rank, [block])
    before = _write_own(store, 0, torch.arange(1000, dtype=torch.float32))
    lo, hi = store.shard.owned(block)
    span = (lo - 100, lo + 100) if rank else (hi - 100, hi + 100)  # across the boundary of the shards
    store.write_span(0, "param", span, -torch.arange(200, dtype=torch.float32))
    expected = before.clone()
    expected[span[0] : span[1]] = -torch.arange(200, dtype=torch.float32)
    with store.pinned(0, "param", span=(lo, hi)) as own:
        kept = torch.equal(own, expected[lo:hi])
    whole = torch.equal(store.read_span(0, "param", (0, 1000)), expected)
    version = store.version(0)
    store.write_span(0, "param", (10, 20), torch.zeros(10))  # rank 0's elements only
    return kept, whole, store.version(0) == version + 1


def test_a_weight_changed_in_place_on_every_rank_is_kept_by_each_owner() -> None:
    """User code that changes a parameter in place runs on every rank: each keeps the elements it owns,
    a read across the ranks sees the whole change, and the block's version moves on every rank (each
    drops its gathered copies alike), the owner's or not."""
    assert _on_two_ranks(_write_span) == [(True, True, True), (True, True, True)]


def _gather_bf16(rank: int, blocks: list[Any]) -> tuple[bool, float]:
    from megatrain_lightning.engine.gathers import GatheredBlocks
    from megatrain_lightning.engine.slots import SlotLayout

    store = _sharded_store(rank, blocks)
    layout = SlotLayout(blocks, torch.bfloat16, mixed=True)
    pager = GatheredBlocks(store, store.stats, layout, torch.device("cpu"), prefetch_depth=0)
    same, least = [], 0.0
    for block in blocks:
        full = torch.randn(block.numel, generator=torch.Generator().manual_seed(block.index))
        _write_own(store, block.index, full)
        expected = torch.zeros(layout.block_bytes[block.index], dtype=torch.uint8)
        layout.copy_in(block.index, full, expected)
        gathered = pager.acquire(block.index, backward=False)
        pager.release(block.index)
        same += [
            torch.equal(layout.view(block.index, i, gathered), layout.view(block.index, i, expected))
            for i in range(len(block.params))
        ]
        dtypes = layout.dtypes[block.index]
        least += sum(p.numel * dtypes[i].itemsize for i, p in enumerate(block.params)) / 2
    return all(same), store.stats.gathered_bytes / least


def test_ranks_gather_a_block_in_the_dtypes_it_computes_in() -> None:
    """Under bf16-mixed each rank sends its share as the slot holds it (bf16 weights, fp32 norms and
    biases): the gathered slot equals the single-rank one bit for bit, and a rank receives about half the
    block's bytes in those dtypes (its share's padding and alignment aside), not half its fp32 bytes."""
    blocks = discover_blocks(tiny_model("gpt2"))  # fp32 norms and biases between bf16 weights
    reports = _on_two_ranks(_gather_bf16, blocks)
    assert [same for same, _ in reports] == [True, True], reports
    assert all(1.0 <= received <= 1.1 for _, received in reports), reports


def _stale_gather(rank: int, blocks: list[Any]) -> tuple[list[bool], int, int]:
    from megatrain_lightning.engine.gathers import GatheredBlocks
    from megatrain_lightning.engine.slots import SlotLayout

    store = _sharded_store(rank, blocks)
    pager = GatheredBlocks(store, store.stats, SlotLayout(blocks, torch.float32), torch.device("cpu"), 1)

    def write(block: int, seed: int) -> torch.Tensor:
        full = torch.randn(blocks[block].numel, generator=torch.Generator().manual_seed(seed))
        return _write_own(store, block, full)

    def use(block: int) -> torch.Tensor:
        slot = pager.acquire(block, backward=False)
        pager.release(block)
        return slot.view(torch.float32)[: blocks[block].numel]

    first, second = write(0, 0), write(1, 1)
    pager.begin_pass("train")
    seen = [torch.equal(use(0), first), torch.equal(use(1), second)]
    pager.begin_pass("train")  # the trace now predicts block 1 after block 0
    seen.append(torch.equal(use(0), first))
    ahead = store.stats.gathers_ahead
    store.will_change(1)  # an update of block 1 announced after its gather started
    updated = write(1, 2)
    seen.append(torch.equal(use(1), updated))
    return seen, ahead, store.stats.gathers_ahead


def test_a_gather_its_shards_update_overtook_is_dropped_and_the_block_gathered_again() -> None:
    """A block gathered ahead whose shard changed after it was sent (the store's version moved on) is not
    used: the next use gathers the updated weights, on every rank alike."""
    blocks = discover_blocks(tiny_model("llama"))
    assert _on_two_ranks(_stale_gather, blocks) == [([True] * 4, 1, 1), ([True] * 4, 1, 1)]
