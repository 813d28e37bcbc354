"""``MegaTrainMonitor``: where each optimizer step's time goes, in the progress bar and the logger."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from typing_extensions import override

from megatrain_lightning.telemetry.timeline import TIMELINE, Timeline, render

_PROG_BAR = ("tokens_per_s", "stall_pct")


def _counters(strategy: Any) -> tuple[float, float, float]:
    """(link bytes, disk bytes, compute-thread wait seconds) so far; zeros without engine stats."""
    stats = getattr(strategy, "stats", None)
    link = getattr(stats, "h2d_bytes", 0) + getattr(stats, "d2h_bytes", 0)
    disk = getattr(stats, "disk_read_bytes", 0) + getattr(stats, "disk_write_bytes", 0)
    wait = getattr(stats, "fetch_wait_s", 0.0) + getattr(stats, "optimizer_wait_s", 0.0)
    return float(link), float(disk), float(wait)


def _tokens(batch: Any) -> int:
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else batch
    return ids.numel() if isinstance(ids, torch.Tensor) else 0


class MegaTrainMonitor(pl.Callback):
    """Logs, once per optimizer step, ``tokens_per_s``, ``link_gbps`` (host<->device bytes of the
    engine), ``disk_gbps`` (disk-tier bytes) and ``stall_pct`` (share of the step the compute thread
    waited for a block fetch or a block update); the first and last are shown in the progress bar.

    A step's time runs from the start of its first micro-batch to the end of its last, so gradient
    accumulation counts and validation does not. Without the megatrain strategy only tokens/s is
    non-zero.

    Args:
        timeline_step: Optimizer step (``trainer.global_step`` when it begins) whose engine events are
            recorded and drawn as a PNG; ``None`` draws none. Step 0 records the trace and is slower,
            so a later step shows the steady state.
        timeline_path: Where to write the PNG; default ``<trainer.log_dir>/timeline_step<N>.png``.
        timeline: The recorder the engine reports to (default: the process-wide one).
    """

    def __init__(
        self,
        timeline_step: int | None = None,
        timeline_path: str | Path | None = None,
        timeline: Timeline | None = None,
    ) -> None:
        if timeline_step is not None and timeline_step < 0:
            raise ValueError(f"timeline_step must be >= 0 or None, got {timeline_step}")
        self.timeline_step = timeline_step
        self.timeline_path = timeline_path
        self.timeline = timeline or TIMELINE
        self.last_timeline: Path | None = None
        self._start: float | None = None
        self._step = 0
        self._tokens = 0
        self._counters = (0.0, 0.0, 0.0)
        self._recording = False

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step, first, end = self.timeline_step, trainer.global_step, trainer.max_steps
        if step is not None and (step < first or 0 <= end <= step):
            rank_zero_warn(
                f"MegaTrainMonitor: timeline_step={step} is not among this run's optimizer steps ({first} "
                f"to {end - 1 if end >= 0 else 'the end'}), so no timeline will be drawn; pick one of them."
            )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._start is not None:
            return  # a later micro-batch of the same optimizer step
        self._step = trainer.global_step
        self._tokens = 0
        self._counters = _counters(trainer.strategy)
        if self._step == self.timeline_step:
            self.timeline.start()
            self._recording = True
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._tokens += _tokens(batch)
        if self._start is None or trainer.global_step == self._step:
            return  # still accumulating gradients
        start, self._start = self._start, None
        elapsed = max(time.perf_counter() - start, 1e-9)
        link, disk, wait = (
            now - before for now, before in zip(_counters(trainer.strategy), self._counters, strict=True)
        )
        metrics = {
            "tokens_per_s": self._tokens / elapsed,
            "link_gbps": link / elapsed / 1e9,
            "disk_gbps": disk / elapsed / 1e9,
            "stall_pct": 100.0 * wait / elapsed,
        }
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=name in _PROG_BAR, batch_size=1)
        if self._recording:
            self._draw(trainer, start, elapsed)

    def _draw(self, trainer: pl.Trainer, origin: float, elapsed: float) -> None:
        events = self.timeline.stop()
        self._recording = False
        if not trainer.is_global_zero:
            return
        if not events:
            rank_zero_warn(
                "MegaTrainMonitor: no engine events were recorded for the timeline (the strategy does not "
                "report to megatrain_lightning.telemetry.timeline.TIMELINE); the PNG shows empty lanes."
            )
        path = self.timeline_path or Path(trainer.log_dir or trainer.default_root_dir) / (
            f"timeline_step{self._step}.png"
        )
        title = f"optimizer step {self._step}: {elapsed * 1e3:.0f} ms, {self._tokens} tokens"
        self.last_timeline = render(events, path, origin=origin, title=title)
        rank_zero_info(
            f"MegaTrainMonitor: wrote the timeline of optimizer step {self._step} to {self.last_timeline}"
        )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._recording:  # training stopped inside the recorded step
            self.timeline.stop()
            self._recording = False
        self._start = None


class StepsProgressBar(RichProgressBar):
    """Lightning's default (rich) progress bar, without its "Epoch 0/-2" for runs bounded by ``max_steps``
    alone (``max_epochs=-1``): the description then names the epoch and the step total."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        trainer = self.trainer
        if trainer.max_epochs is not None and trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        description = f"Epoch {current_epoch} (max_steps={trainer.max_steps})"
        return f"{description:{len(self.validation_description)}}"


def with_progress_bar(callbacks: list[pl.Callback], enabled: bool = True) -> list[pl.Callback]:
    """``callbacks`` plus :class:`StepsProgressBar` where Lightning would add its rich bar."""
    if not enabled or not _RICH_AVAILABLE or any(isinstance(c, ProgressBar) for c in callbacks):
        return callbacks
    return [*callbacks, StepsProgressBar()]
