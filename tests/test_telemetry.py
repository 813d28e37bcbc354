"""MegaTrainMonitor's per-step metrics and the timeline recorder and its PNG."""

from __future__ import annotations

import csv
import logging
import struct
import threading
import time
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from megatrain_lightning.data import TextDataModule
from megatrain_lightning.models import CausalLMModule
from megatrain_lightning.telemetry.monitor import MegaTrainMonitor, StepsProgressBar, with_progress_bar
from megatrain_lightning.telemetry.timeline import LANES, Timeline, render


def assert_png(path: Path, min_size: tuple[int, int] = (200, 100)) -> None:
    """A PNG signature and an IHDR chunk of at least ``min_size`` pixels."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    width, height = struct.unpack(">II", data[16:24])
    assert width >= min_size[0] and height >= min_size[1] and len(data) > 2000


def test_timeline_records_only_while_enabled_from_many_threads():
    timeline = Timeline()
    timeline.record("fetch", 0.0, 1.0)
    with timeline.span("compute"):
        pass
    timeline.start()

    def work(lane: str) -> None:
        for i in range(200):
            timeline.record(lane, float(i), i + 0.5)

    threads = [threading.Thread(target=work, args=(lane,)) for lane in LANES]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with timeline.span("compute"):
        time.sleep(0.001)
    events = timeline.stop()
    assert len(events) == 5 * 200 + 1
    assert events[-1].lane == "compute" and events[-1].end - events[-1].start >= 0.001
    timeline.record("fetch", 0.0, 1.0)
    assert timeline.stop() == []


def test_render_synthetic_step(tmp_path):
    timeline = Timeline()
    timeline.start()
    t0 = 100.0
    for block in range(4):  # fetch block i+1 while computing block i; offload and update behind
        timeline.record("fetch", t0 + block * 0.010, t0 + block * 0.010 + 0.008)
        timeline.record("compute", t0 + (block + 1) * 0.010, t0 + (block + 1) * 0.010 + 0.009)
        timeline.record("offload", t0 + (block + 1) * 0.010 + 0.009, t0 + (block + 2) * 0.010)
        timeline.record("optimizer", t0 + (block + 2) * 0.010, t0 + (block + 2) * 0.010 + 0.012)
        timeline.record("disk", t0 + block * 0.010 - 0.005, t0 + block * 0.010)
    timeline.record("h2d-extra", t0, t0 + 0.001)  # a lane of its own below the standard ones
    path = render(timeline.stop(), tmp_path / "sub" / "step.png", origin=t0, title="synthetic")
    assert path == tmp_path / "sub" / "step.png"
    assert_png(path)
    assert_png(render([], tmp_path / "empty.png"))


class _SyntheticEngine(L.Callback):
    """Stands in for the engine's reports: one span per lane each micro-batch."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        for i, lane in enumerate(LANES):
            self.timeline.record(lane, now - 0.002 * (i + 1), now - 0.002 * i)


@pytest.mark.parametrize("strategy", ["megatrain", "auto"])
def test_monitor_logs_each_optimizer_step_and_draws_the_timeline(tmp_path, strategy):
    messages = _Messages()
    lightning_log = logging.getLogger("lightning.pytorch")
    lightning_log.addHandler(messages)
    level, _ = lightning_log.level, lightning_log.setLevel(logging.INFO)
    timeline = Timeline()
    monitor = MegaTrainMonitor(timeline_step=1, timeline=timeline)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_steps=4,
        accumulate_grad_batches=2,
        log_every_n_steps=1,
        val_check_interval=4,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=CSVLogger(tmp_path, name="run"),
        callbacks=[monitor, _SyntheticEngine(timeline)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(CausalLMModule("llama"), datamodule=TextDataModule(seq_len=32, batch_size=2))

    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    steps = [r for r in rows if r.get("tokens_per_s")]
    assert [int(r["step"]) for r in steps] == [0, 1, 2, 3]  # once per optimizer step, not per micro-batch
    for r in steps:
        assert float(r["tokens_per_s"]) > 0 and 0 <= float(r["stall_pct"]) <= 100
        assert float(r["disk_gbps"]) == 0
        assert (float(r["link_gbps"]) > 0) == (strategy == "megatrain")  # weights in, gradients out
    assert any(r.get("val_ppl") for r in rows)
    assert {"tokens_per_s", "stall_pct"} <= set(trainer.progress_bar_metrics)

    assert monitor.last_timeline == tmp_path / "run" / "version_0" / "timeline_step1.png"
    assert_png(monitor.last_timeline)
    assert not timeline.enabled
    lightning_log.removeHandler(messages)
    lightning_log.setLevel(level)
    assert f"wrote the timeline of optimizer step 1 to {monitor.last_timeline}" in "\n".join(messages.lines)


def test_a_timeline_step_the_run_never_reaches_is_warned_about():
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        callbacks=[MegaTrainMonitor(timeline_step=5)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(
        UserWarning, match="timeline_step=5 is not among this run's optimizer steps \\(0 to 1\\)"
    ):
        trainer.fit(CausalLMModule("llama"), datamodule=TextDataModule(seq_len=32, batch_size=2))


class _Messages(logging.Handler):
    """The messages Lightning's logger passes on, whatever its level is set to."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize(("max_epochs", "expected"), [(None, "Epoch 0 (max_steps=3)"), (2, "Epoch 0/1")])
def test_progress_bar_of_a_max_steps_run_has_no_negative_total(max_epochs, expected):
    bar = StepsProgressBar()
    trainer = L.Trainer(max_steps=3, max_epochs=max_epochs, callbacks=[bar], logger=False)
    assert trainer.progress_bar_callback is bar
    bar.setup(trainer, None, "fit")
    assert bar._get_train_description(0).strip() == expected
    assert with_progress_bar([bar]) == [bar] and with_progress_bar([], enabled=False) == []
    assert isinstance(with_progress_bar([])[-1], StepsProgressBar)
