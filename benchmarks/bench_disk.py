"""The disk tier (``offload_dir``) against the disk it runs on, plain Lightning and DeepSpeed.

Four parts (``--parts``), each side by side in one process (the DeepSpeed peer in a child process),
ratios printed. The disk's sequential O_DIRECT GB/s (fio, else dd) is measured in each part just
before and just after its runs, in the same folder as the store.

- ``overlap``: the ~170M Llama, fp32, batch 1 x ``--seq``: plain Lightning; megatrain's host tier
  with the whole model in slots (compute-only) and with 2 slots; the disk tier with ``max_cpu_gb``
  below weights + Adam state and a slot budget of 2 blocks, without and with activation
  checkpointing; ``--repeats`` round-robin passes. Ratios: disk step / plain step, and disk step /
  max(compute-only step, the disk time its bytes need at the measured GB/s).
- ``efficiency``: an I/O-bound run (a Llama of 16 layers of the 170M shape with a vocabulary of
  8192, 0.89 GB fp32; batch 1 x 16 tokens; ``max_cpu_gb`` = a quarter of weights + Adam state; a
  slot budget of 4 blocks): the store's read and write GB/s against the disk's, and its traffic by
  file against the least it could move.
- ``sweep``: ``io_threads`` x ``io_chunk_mb`` on that model: the raw I/O path (``BlockFile`` in a
  thread pool, as the store issues it) over the whole grid, and training runs along each axis.
- ``peer``: DeepSpeed ZeRO-3 with parameters and optimizer state on NVMe (``ds_peer.py``, same
  weights and batches) against the overlap part's disk-tier run.
- ``traffic``: the I/O-bound run's model with a host cache of 0.14 and 0.77 of weights + optimizer state,
  fp32 and bf16-mixed with int4 moments, with and without accumulation: store bytes per step by file
  against the least its schedule allows (``planner.traffic.least_disk_traffic``).

Store I/O is timed by wrapping ``BlockFile.read``/``write`` in this process (the engine is not
changed): the time during which at least one read (write, either) is in flight gives the rate
"while active"; ``stats.disk_read_s`` sums the I/O threads' times, so bytes / it is a per-thread
rate. Steps during which other processes used the CPU are set aside as ``bench_engine`` does.
``python benchmarks/bench_disk.py --quick`` is a smoke run of all parts on small models.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import gc
import json
import os
import queue
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader
from transformers import PretrainedConfig, PreTrainedModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import (  # noqa: E402
    FOREIGN_SHARE,
    BenchModule,
    StepTimer,
    bench_config,
    block_bytes,
    build_model,
    close,
    free_earlier_runs,
    make_batches,
    trainer_kwargs,
)

from megatrain_lightning import MegaTrainStrategy  # noqa: E402
from megatrain_lightning.engine.blocks import discover_blocks  # noqa: E402
from megatrain_lightning.planner.traffic import DiskTraffic, least_disk_traffic  # noqa: E402
from megatrain_lightning.presets import llama_config  # noqa: E402
from megatrain_lightning.store import sizing  # noqa: E402
from megatrain_lightning.store.io import BlockFile, IOConfig  # noqa: E402
from megatrain_lightning.store.memory import ALIGNMENT, host_empty  # noqa: E402

GB = 1e9
EFFICIENCY_GOAL = 0.85  # store GB/s / disk GB/s, at least
PLAIN_GOAL = 1.25  # disk-tier step / plain step, at most
BOUND_GOAL = 1.15  # disk-tier step / max(compute-only, disk time), at most
PEER_GOAL = 3.0  # DeepSpeed step / disk-tier step, at least
PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_peer.py")
STATE_BYTES = 12  # bytes per parameter of weights + Adam m + v (fp32): the store's size
DEFAULT_THREADS, DEFAULT_CHUNK_MB = 4, 16  # MegaTrainStrategy's io_threads, io_chunk_mb
EFFICIENCY_SEQ, EFFICIENCY_SLOTS = 16, 4  # few tokens: I/O-bound; slots: a GPU's few blocks
OVERLAP_SLOTS = 2
PARTS = ("overlap", "efficiency", "sweep", "peer", "traffic")
# traffic: cache / (weights + optimizer state) as in the 7B (0.14) and 1B (0.77) scale.py runs, precision,
# optimizer_compression, accumulate_grad_batches
TRAFFIC_CASES = (
    (0.14, "32-true", "none", 1),
    (0.14, "bf16-mixed", "int4", 1),
    (0.77, "32-true", "none", 1),
    (0.77, "bf16-mixed", "int4", 1),
    (0.14, "32-true", "none", 2),
    (0.77, "bf16-mixed", "int4", 2),
)
TRAFFIC_STEPS = 5  # the first two record the trace and update late: not counted
TRAFFIC_CHUNKS = 50  # chunks per largest block, as 16 MB chunks are to a 7B layer


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def seconds(values: Sequence[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


# -- the disk's own speed --


@dataclass(frozen=True)
class Speed:
    """Sequential GB/s of one measurement, reading and writing."""

    read: float
    write: float


def fio_rate(path: str, size: int, rw: str, block: str, depth: int) -> float:
    """GB/s of one sequential O_DIRECT fio job (``rw``: read or write) over ``size`` bytes of ``path``."""
    engine = "psync" if depth == 1 else "libaio"
    job = [f"--filename={path}", f"--size={size}", f"--rw={rw}", f"--bs={block}", "--direct=1"]
    job += [f"--ioengine={engine}", f"--iodepth={depth}", "--output-format=json"]
    out = subprocess.run(["fio", "--name=seq", *job], check=True, capture_output=True, text=True).stdout
    return json.loads(out[out.index("{") :])["jobs"][0][rw]["bw_bytes"] / GB


def dd_rate(path: str, size: int, rw: str, block_mb: int) -> float:
    """GB/s of ``dd`` with ``oflag=direct`` (write, from /dev/zero) or ``iflag=direct`` (read)."""
    count = max(1, size // (block_mb << 20))
    if rw == "read":
        io = [f"if={path}", "of=/dev/null", "iflag=direct"]
    else:
        io = ["if=/dev/zero", f"of={path}", "oflag=direct", "conv=fsync"]
    start = time.perf_counter()
    subprocess.run(["dd", *io, f"bs={block_mb}M", f"count={count}"], check=True, capture_output=True)
    return count * (block_mb << 20) / (time.perf_counter() - start) / GB


def measure_disk(directory: str, size: int) -> dict[str, Speed]:
    """Sequential O_DIRECT write then read of a ``size``-byte file in ``directory``, per job shape."""
    path = os.path.join(directory, "seq_test.bin")
    try:
        if shutil.which("fio"):
            shapes = {"fio 8M QD1": ("8M", 1), "fio 1M QD32": ("1M", 32)}
            return {
                label: Speed(
                    write=fio_rate(path, size, "write", bs, depth),
                    read=fio_rate(path, size, "read", bs, depth),
                )
                for label, (bs, depth) in shapes.items()
            }
        return {"dd 8M": Speed(write=dd_rate(path, size, "write", 8), read=dd_rate(path, size, "read", 8))}
    finally:
        if os.path.exists(path):
            os.remove(path)


@dataclass
class DiskReference:
    """The disk's sequential O_DIRECT speed, measured before and after the runs it is set against."""

    runs: list[dict[str, Speed]] = field(default_factory=list)

    def measure(self, directory: str, size: int, when: str) -> None:
        shapes = measure_disk(directory, size)
        self.runs.append(shapes)
        text = ", ".join(f"{k}: read {v.read:.2f} write {v.write:.2f}" for k, v in shapes.items())
        print(f"disk, sequential O_DIRECT GB/s ({when}): {text}", flush=True)

    @property
    def speeds(self) -> list[Speed]:
        """Per measurement, the faster job shape in each direction."""
        return [
            Speed(read=max(s.read for s in run.values()), write=max(s.write for s in run.values()))
            for run in self.runs
        ]

    @property
    def speed(self) -> Speed:
        """Per direction the faster job shape, averaged over the measurements."""
        speeds = self.speeds
        return Speed(
            read=statistics.mean(s.read for s in speeds), write=statistics.mean(s.write for s in speeds)
        )

    def describe(self) -> str:
        reads, writes = [s.read for s in self.speeds], [s.write for s in self.speeds]
        s = self.speed
        return (
            f"read {s.read:.2f} GB/s ({min(reads):.2f}-{max(reads):.2f}), "
            f"write {s.write:.2f} GB/s ({min(writes):.2f}-{max(writes):.2f}) "
            f"over {len(self.runs)} measurement(s)"
        )


def check_direct(directory: str) -> None:
    """Warn when ``directory`` refuses O_DIRECT: then the store and dd/fio would measure the page cache."""
    path = os.path.join(directory, "direct_probe")
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        print(f"WARNING: {directory} refuses O_DIRECT (tmpfs?); pass --dir on the disk to measure.")
    finally:
        if os.path.exists(path):
            os.remove(path)


# -- timing the store's I/O from outside the engine --


class IOTrace:
    """While active, records every ``BlockFile.read``/``write`` (the store's I/O calls): the operation, the
    file's kind (``param``, ``grad``, ``exp_avg``, ...), the interval and the bytes."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, float, float, int]] = []  # (op "R"/"W", kind, start, end, bytes)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def active(self) -> Iterator[IOTrace]:
        read, write = BlockFile.read, BlockFile.write
        BlockFile.read = self._timed("R", read)  # type: ignore[method-assign]
        BlockFile.write = self._timed("W", write)  # type: ignore[method-assign]
        try:
            yield self
        finally:
            BlockFile.read, BlockFile.write = read, write  # type: ignore[method-assign]

    def _timed(self, op: str, method: Callable[[BlockFile, int, Tensor], None]) -> Callable:
        def timed(file: BlockFile, offset: int, buf: Tensor) -> None:
            start = time.perf_counter()
            method(file, offset, buf)
            kind = os.path.basename(file.path).removesuffix(".bin")
            with self._lock:
                self.events.append((op, kind, start, time.perf_counter(), buf.numel()))

        return timed

    def busy_s(self, ops: str, t0: float, t1: float) -> float:
        """Seconds within ``[t0, t1)`` during which an operation in ``ops`` ("R", "W", "RW") was in flight."""
        spans = sorted(
            (max(s, t0), min(e, t1)) for o, _, s, e, _ in self.events if o in ops and e > t0 and s < t1
        )
        total, cur_start, cur_end = 0.0, 0.0, None
        for start, end in spans:
            if cur_end is None or start > cur_end:
                total += 0.0 if cur_end is None else cur_end - cur_start
                cur_start, cur_end = start, end
            else:
                cur_end = max(cur_end, end)
        return total + (0.0 if cur_end is None else cur_end - cur_start)

    def by_kind(self, t0: float, t1: float) -> dict[tuple[str, str], tuple[int, int]]:
        """``(op, kind) -> (calls, bytes)`` of the operations that started within ``[t0, t1)``."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for op, kind, start, _, nbytes in self.events:
            if t0 <= start < t1:
                calls, total = out.get((op, kind), (0, 0))
                out[op, kind] = (calls + 1, total + nbytes)
        return out


# -- timed Lightning runs --


class UsageTimer(StepTimer):
    """``bench_engine``'s step timer, also noting the process's system CPU time and minor page faults
    (first touches of new memory) at each batch start."""

    def __init__(self) -> None:
        super().__init__()
        self.usage: list[tuple[float, int]] = []

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.usage.append((usage.ru_stime, usage.ru_minflt))


@dataclass
class Run:
    """The timed steps of one Lightning run and what its engine did during them."""

    label: str
    step_s: list[float]
    cpu_s: list[float]  # process CPU time (all threads, user + system)
    sys_s: list[float]  # of which system
    faults: list[int]  # minor page faults
    foreign_s: list[float]  # CPU time the rest of the machine used meanwhile (see bench_engine)
    losses: list[float]  # every step's, of the first run
    load: float  # 1-minute load average when it ended (the highest, pooled)
    stats: dict[str, float] = field(default_factory=dict)  # engine counters summed over the timed steps
    busy: dict[str, float] = field(default_factory=dict)  # "R", "W", "RW": seconds with I/O in flight
    traffic: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)  # see IOTrace.by_kind
    peak_cache_bytes: int = 0

    @property
    def clean(self) -> list[int]:
        """Indices of the timed steps that other processes did not disturb (``bench_engine``'s rule)."""
        return [
            i
            for i, (t, f) in enumerate(zip(self.step_s, self.foreign_s, strict=True))
            if f <= max(FOREIGN_SHARE * t, 0.02)
        ]

    @property
    def median_s(self) -> float:
        """Median step time over the clean steps (over all of them if none is clean)."""
        clean = self.clean
        return statistics.median([self.step_s[i] for i in clean] if clean else self.step_s)

    @property
    def min_s(self) -> float:
        return min(self.step_s)

    @property
    def wall_s(self) -> float:
        return sum(self.step_s)

    @property
    def faulted_gb(self) -> float:
        """GB of memory first touched (minor page faults) per step, median."""
        return statistics.median(self.faults) * resource.getpagesize() / GB

    def per_step(self, key: str) -> float:
        return self.stats.get(key, 0.0) / len(self.step_s)

    def disk_time(self, disk: Speed) -> float:
        """Seconds per step the disk needs for this run's store traffic at its sequential speed."""
        return (
            self.per_step("disk_read_bytes") / disk.read + self.per_step("disk_write_bytes") / disk.write
        ) / GB

    def absorb(self, other: Run) -> None:
        """Pool ``other`` (a repeat of the same case) into this run."""
        for name in ("step_s", "cpu_s", "sys_s", "faults", "foreign_s"):
            getattr(self, name).extend(getattr(other, name))
        self.load = max(self.load, other.load)
        for key, value in other.stats.items():
            self.stats[key] = self.stats.get(key, 0) + value
        for key, value in other.busy.items():
            self.busy[key] = self.busy.get(key, 0.0) + value
        for key, (calls, nbytes) in other.traffic.items():
            have = self.traffic.get(key, (0, 0))
            self.traffic[key] = (have[0] + calls, have[1] + nbytes)
        self.peak_cache_bytes = max(self.peak_cache_bytes, other.peak_cache_bytes)


def timed_run(
    label: str,
    model: PreTrainedModel,
    batches: Sequence[dict[str, Tensor]],
    warmup: int,
    strategy: MegaTrainStrategy | str,
    trace: IOTrace | None = None,
) -> Run:
    """Train a deep copy of ``model`` one step per batch, fp32 on the CPU; time the steps after ``warmup``
    (the last batch only closes the last timed step), as ``bench_engine`` does. With ``trace``, time the
    store's I/O."""
    print(f"  {label} ...", flush=True)
    free_earlier_runs()
    timer = UsageTimer()
    trainer = L.Trainer(
        strategy=strategy, max_steps=len(batches), callbacks=[timer], **trainer_kwargs("cpu", "32-true")
    )
    with trace.active() if trace is not None else contextlib.nullcontext():
        trainer.fit(BenchModule(copy.deepcopy(model)), DataLoader(list(batches), batch_size=None))
    first, last = warmup, len(batches) - 1
    timed = range(first, last)
    run = Run(
        label,
        step_s=[timer.starts[i + 1] - timer.starts[i] for i in timed],
        cpu_s=[timer.cpu_starts[i + 1] - timer.cpu_starts[i] for i in timed],
        sys_s=[timer.usage[i + 1][0] - timer.usage[i][0] for i in timed],
        faults=[timer.usage[i + 1][1] - timer.usage[i][1] for i in timed],
        foreign_s=[
            timer.busy[i + 1] - timer.busy[i] - (timer.cpu_starts[i + 1] - timer.cpu_starts[i]) for i in timed
        ],
        losses=timer.losses,
        load=os.getloadavg()[0],
    )
    if isinstance(strategy, MegaTrainStrategy):
        assert strategy.engine is not None
        strategy.engine.wait_all()
        a, b = timer.stats[first], timer.stats[last]
        run.stats = {k: b[k] - a[k] for k in a}
        run.peak_cache_bytes = strategy.stats.peak_host_cache_bytes
        if trace is not None:
            t0, t1 = timer.starts[first], timer.starts[last]
            run.busy = {ops: trace.busy_s(ops, t0, t1) for ops in ("R", "W", "RW")}
            run.traffic = trace.by_kind(t0, t1)
    close(trainer)
    return run


def megatrain(
    model: PreTrainedModel,
    slots: int | None = None,
    offload_dir: str | None = None,
    cache_bytes: float | None = None,
    checkpointing: bool = False,
    io_threads: int = DEFAULT_THREADS,
    io_chunk_mb: int = DEFAULT_CHUNK_MB,
) -> MegaTrainStrategy:
    """megatrain with a slot budget of ``slots`` largest blocks (``None``: the whole model); with
    ``offload_dir``, the disk tier there with a host cache of ``cache_bytes``."""
    _, largest, _ = block_bytes(model)
    return MegaTrainStrategy(
        max_vram_gb=None if slots is None else largest * slots * 1.001 / GB,
        offload_dir=offload_dir,
        max_cpu_gb=None if cache_bytes is None else cache_bytes / GB,
        activation_checkpointing=checkpointing,
        io_threads=io_threads,
        io_chunk_mb=io_chunk_mb,
    )


def store_bytes(model: PreTrainedModel) -> int:
    """fp32 weights + Adam m and v: what the store holds apart from gradients."""
    return STATE_BYTES * sum(p.numel() for p in model.parameters())


def describe_model(model: PreTrainedModel, batch: int, seq: int) -> str:
    model_bytes, largest, num_blocks = block_bytes(model)
    return (
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {model_bytes / GB:.3f} GB fp32 "
        f"weights, {store_bytes(model) / GB:.2f} GB with Adam m+v; {num_blocks} blocks, largest "
        f"{largest / 1e6:.1f} MB; batch {batch} x {seq}; {torch.get_num_threads()} threads"
    )


def engine_time(run: Run) -> None:
    """Where the step's time went, from ``strategy.stats`` (per timed step)."""
    keys = ("fetch_wait_s", "optimizer_s", "optimizer_wait_s", "disk_read_s", "disk_write_s", "h2d_s")
    per = ", ".join(f"{k} {run.per_step(k):.2f}" for k in keys)
    moved = ("disk_read_bytes", "disk_write_bytes", "h2d_bytes", "d2h_bytes")
    print(f"{run.label} per step: {per}; " + ", ".join(f"{k} {run.per_step(k) / GB:.3f} GB" for k in moved))


def traffic_table(run: Run, num_blocks: int) -> None:
    """Store traffic per step by file, and how many times per step each block's region moved."""
    steps = len(run.step_s)
    print(
        f"\n{'file':<15} {'read GB/step':>12} {'reads/block':>11} {'write GB/step':>13} {'writes/block':>12}"
    )
    for kind in sorted({k for _, k in run.traffic}):
        reads, read_bytes = run.traffic.get(("R", kind), (0, 0))
        writes, write_bytes = run.traffic.get(("W", kind), (0, 0))
        print(
            f"{kind + '.bin':<15} {read_bytes / steps / GB:12.3f} {reads / steps / num_blocks:11.2f} "
            f"{write_bytes / steps / GB:13.3f} {writes / steps / num_blocks:12.2f}"
        )


# -- store traffic against the least --


class StepEnds(L.Callback):
    """When each optimizer step ended (the last micro-batch of an accumulation)."""

    def __init__(self) -> None:
        self.ends: dict[int, float] = {}
        self.state_kinds: tuple[str, ...] = ()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.ends[trainer.global_step] = time.perf_counter()
        self.state_kinds = trainer.strategy.engine.optimizer.state_kinds


def traffic(args: argparse.Namespace, directory: str) -> None:
    print("\n== traffic: store bytes per step against the least the schedule allows ==", flush=True)
    config, model, _ = efficiency_model(args.quick)
    _, largest, num_blocks = block_bytes(model)
    blocks = discover_blocks(model)
    chunk_mb = largest / TRAFFIC_CHUNKS / 2**20
    print(f"model: {describe_model(model, 1, EFFICIENCY_SEQ)}; io_chunk_mb {chunk_mb:.3g}; steps 3..5")
    for share, precision, compression, accumulate in TRAFFIC_CASES:
        size = sizing.region_bytes(blocks) + sizing.state_bytes(blocks, compression)
        strategy = MegaTrainStrategy(
            max_vram_gb=EFFICIENCY_SLOTS * largest * 1.001 / GB,
            offload_dir=directory,
            max_cpu_gb=share * size / GB,
            io_chunk_mb=chunk_mb,
            optimizer_compression=compression,
        )
        ends, trace = StepEnds(), IOTrace()
        trainer = L.Trainer(
            strategy=strategy,
            max_steps=TRAFFIC_STEPS,
            callbacks=[ends],
            accumulate_grad_batches=accumulate,
            **trainer_kwargs("cpu", precision),
        )
        batches = make_batches(config.vocab_size, TRAFFIC_STEPS * accumulate, 1, EFFICIENCY_SEQ)
        with trace.active():
            trainer.fit(BenchModule(copy.deepcopy(model)), DataLoader(batches, batch_size=None))
        store = strategy.engine.store
        least = least_disk_traffic(
            store.stored_bytes("param"),
            sum(store.stored_bytes(kind) for kind in ends.state_kinds),
            store.cache_bytes,
            accumulate,
            largest,
        )
        steps = TRAFFIC_STEPS - 2
        moved = trace.by_kind(ends.ends[2], ends.ends[TRAFFIC_STEPS])
        figures = ", ".join(f"{k} {v / GB:.4f}" for k, v in dataclasses.asdict(least).items())
        print(
            f"\ncache {share} of the store ({store.cache_bytes / GB:.3f} GB), {precision}, moments "
            f"{compression}, accumulate {accumulate}: the least per step (GB): {figures}"
        )
        traffic_table(Run("", [0.0] * steps, [], [], [], [], [], 0.0, traffic=moved), num_blocks)
        for op, name, bound in (("R", "read", least.reads), ("W", "written", least.writes)):
            total = sum(b for (o, _), (_, b) in moved.items() if o == op) / steps
            print(f"{name} {total / GB:.4f} GB/step, least {bound / GB:.4f}: {total / bound:.2f}x")
        close(trainer)


# -- part 1: disk efficiency --


def efficiency_config(quick: bool) -> PretrainedConfig:
    """Uniform blocks (a small vocabulary), so the cache holds a quarter of the store in whole blocks."""
    if quick:
        shape = dict(hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=4)
        return llama_config("170m", num_hidden_layers=16, vocab_size=2048, **shape)
    return llama_config("170m", num_hidden_layers=16, vocab_size=8192)


def store_rates(run: Run, reference: DiskReference, least: DiskTraffic) -> None:
    """Print the store's GB/s three ways against the disk's, the share of disk time the run used (for
    the mean and for each measurement of the disk), and the share the ``least`` traffic would use."""
    wall, disk = run.wall_s, reference.speed
    print(
        f"\n{'':6} {'GB/step':>8} {'GB/s wall':>10} {'/disk':>6} {'GB/s active':>12} {'/disk':>6} "
        f"{'GB/s per thread':>16} {'disk GB/s':>10}"
    )
    for name, op, ref in (("read", "R", disk.read), ("write", "W", disk.write)):
        moved = run.stats[f"disk_{name}_bytes"] / GB
        active = moved / run.busy[op] if run.busy[op] else float("nan")
        spent = run.stats[f"disk_{name}_s"]
        thread = moved / spent if spent else float("nan")
        print(
            f"{name:6} {moved / len(run.step_s):8.3f} {moved / wall:10.3f} {moved / wall / ref:6.2f} "
            f"{active:12.3f} {active / ref:6.2f} {thread:16.3f} {ref:10.2f}"
        )
    print(
        f"\nI/O in flight: reads {run.busy['R'] / wall:.0%} of the wall time, "
        f"writes {run.busy['W'] / wall:.0%}, either {run.busy['RW'] / wall:.0%}."
    )
    need = run.disk_time(disk) * len(run.step_s)
    util, active = need / wall, need / run.busy["RW"]
    spread = [run.disk_time(s) * len(run.step_s) / wall for s in reference.speeds]
    print(
        f"disk time (read bytes / disk read GB/s + write bytes / disk write GB/s) / wall time = {util:.2f} "
        f"(goal >= {EFFICIENCY_GOAL}: {verdict(util >= EFFICIENCY_GOAL)}; "
        f"{min(spread):.2f}-{max(spread):.2f} with each disk measurement alone); "
        f"/ time with I/O in flight = {active:.2f}"
    )
    useful = (least.reads / GB / disk.read + least.writes / GB / disk.write) / run.median_s
    read, write = (
        run.per_step(f"disk_{k}_bytes") / b for k, b in (("read", least.reads), ("write", least.writes))
    )
    print(
        f"useful: the least traffic of a step ({least.reads / GB:.3f} GB read, {least.writes / GB:.3f} GB "
        f"written: planner.traffic.least_disk_traffic) at disk speed / step time = {useful:.2f}; moved / "
        f"least: read {read:.2f}x, write {write:.2f}x"
    )


def raw_sweep(
    directory: str, block: int, total: int, passes: int, threads_list: Sequence[int], chunks: Sequence[int]
) -> dict[tuple[int, int], Speed]:
    """GB/s of the store's I/O path alone: ``BlockFile`` writes, then reads, of ``block``-byte regions
    covering ``total`` bytes, ``threads`` at a time as the store's worker pool issues them, for every
    ``(threads, chunk_mb)``; the median over ``passes`` passes, alternately forward and backward."""
    block = -(-block // ALIGNMENT) * ALIGNMENT
    count = max(1, total // block)
    grid = [(t, c) for t in threads_list for c in chunks]
    samples: dict[tuple[int, int], list[Speed]] = {trial: [] for trial in grid}
    for p in range(passes):
        for threads, chunk_mb in grid if p % 2 == 0 else reversed(grid):
            buffers: queue.SimpleQueue[Tensor] = queue.SimpleQueue()
            for _ in range(threads):
                buffers.put(host_empty(block, torch.uint8).random_(0, 256))
            path = os.path.join(directory, "raw.bin")
            file = BlockFile(path, block * count, IOConfig(chunk_bytes=chunk_mb << 20, threads=threads))

            def one(
                op: Callable[[int, Tensor], None], index: int, buffers: queue.SimpleQueue = buffers
            ) -> None:
                buf = buffers.get()
                op(index * block, buf)
                buffers.put(buf)

            rates = []
            with ThreadPoolExecutor(threads) as pool:
                for op in (file.write, file.read):
                    start = time.perf_counter()
                    list(pool.map(functools.partial(one, op), range(count)))
                    rates.append(block * count / (time.perf_counter() - start) / GB)
            file.close()
            os.remove(path)
            samples[threads, chunk_mb].append(Speed(write=rates[0], read=rates[1]))
    return {
        trial: Speed(
            read=statistics.median(s.read for s in runs), write=statistics.median(s.write for s in runs)
        )
        for trial, runs in samples.items()
    }


def train_sweep(
    model: PreTrainedModel,
    batches: Sequence[dict[str, Tensor]],
    directory: str,
    cache: float,
    repeats: int,
    disk: Speed,
    threads_list: Sequence[int],
    chunks: Sequence[int],
) -> None:
    """I/O-bound steps along each axis (``io_threads`` at the default chunk, ``io_chunk_mb`` at the
    default thread count), ``repeats`` passes, alternately forward and backward. Two warm-up steps
    per run: the first step that reads optimizer state from disk is the third (before that, m and v
    are zeros, never written)."""
    trials = [(t, DEFAULT_CHUNK_MB) for t in threads_list]
    trials += [(DEFAULT_THREADS, c) for c in chunks if c != DEFAULT_CHUNK_MB]
    runs: dict[tuple[int, int], list[Run]] = {trial: [] for trial in trials}
    trace = IOTrace()
    for repeat in range(repeats):
        for threads, chunk in trials if repeat % 2 == 0 else reversed(trials):
            strategy = megatrain(
                model, EFFICIENCY_SLOTS, directory, cache, io_threads=threads, io_chunk_mb=chunk
            )
            runs[threads, chunk].append(
                timed_run(f"io_threads={threads} io_chunk_mb={chunk}", model, batches, 2, strategy, trace)
            )
    print(
        f"\n{'io_threads':>10} {'io_chunk_mb':>11} {'step s (median)':>16} {'steps':>20} {'read GB':>8} "
        f"{'write GB':>9} {'disk time/wall':>15}"
    )
    for (threads, chunk), group in runs.items():
        steps = [t for r in group for t in r.step_s]
        util = sum(r.disk_time(disk) * len(r.step_s) for r in group) / sum(r.wall_s for r in group)
        read, write = (
            statistics.mean(r.per_step(f"disk_{k}_bytes") for r in group) / GB for k in ("read", "write")
        )
        print(
            f"{threads:10d} {chunk:11d} {statistics.median(steps):16.2f} {seconds(steps):>20} {read:8.2f} "
            f"{write:9.2f} {util:15.2f}"
        )
    print("(read GB, write GB: store traffic per step; disk time/wall: at the disk reference's GB/s)")


def efficiency_model(quick: bool) -> tuple[PretrainedConfig, PreTrainedModel, float]:
    """The I/O-bound run's config, model and host cache (a quarter of weights + Adam state)."""
    config = efficiency_config(quick)
    model = build_model(config)
    return config, model, store_bytes(model) / 4


def efficiency(args: argparse.Namespace, directory: str) -> None:
    print("\n== disk efficiency: an I/O-bound run against the disk ==", flush=True)
    config, model, cache = efficiency_model(args.quick)
    _, _, num_blocks = block_bytes(model)
    warmup, steps = (2, 1) if args.quick else (2, 4)  # the third step is the first to read m and v
    print(
        f"model: {describe_model(model, 1, EFFICIENCY_SEQ)}; max_cpu_gb {cache / GB:.3f} (a quarter of "
        f"weights + Adam), slots {EFFICIENCY_SLOTS} blocks, io_threads {DEFAULT_THREADS}, "
        f"io_chunk_mb {DEFAULT_CHUNK_MB}; "
        f"{warmup} warm-up + {steps} timed steps; load average {os.getloadavg()[0]:.2f}"
    )
    batches = make_batches(config.vocab_size, warmup + steps + 1, 1, EFFICIENCY_SEQ)
    reference = DiskReference()
    reference.measure(directory, args.disk_test_bytes, "before")
    strategy = megatrain(model, EFFICIENCY_SLOTS, directory, cache)
    run = timed_run("disk tier, I/O-bound", model, batches, warmup, strategy, IOTrace())
    reference.measure(directory, args.disk_test_bytes, "after")
    print(f"\ndisk reference: {reference.describe()}")
    print(
        f"step median {run.median_s:.3f} s ({seconds(run.step_s)}; {len(run.clean)} clean, other processes "
        f"{statistics.median(run.foreign_s):.2f} CPU s/step), cpu {statistics.median(run.cpu_s):.2f} "
        f"s/step of which system {statistics.median(run.sys_s):.2f}, memory first touched "
        f"{run.faulted_gb:.2f} GB/step; load average {run.load:.2f}; peak host cache "
        f"{run.peak_cache_bytes / GB:.3f} GB"
    )
    weights, largest, _ = block_bytes(model)
    store_rates(run, reference, least_disk_traffic(weights, 2 * weights, cache, 1, largest))
    traffic_table(run, num_blocks)
    engine_time(run)


def sweep(args: argparse.Namespace, directory: str) -> None:
    print("\n== sweep: io_threads x io_chunk_mb, on the I/O-bound run's model ==", flush=True)
    config, model, cache = efficiency_model(args.quick)
    _, largest, _ = block_bytes(model)
    reference = DiskReference()
    reference.measure(directory, args.disk_test_bytes, "before")
    disk = reference.speed
    print(f"\n-- the I/O engine alone (BlockFile in a thread pool), {largest / 1e6:.0f} MB regions --")
    threads_list, chunks = args.sweep_threads, args.sweep_chunks
    raw = raw_sweep(directory, largest, args.sweep_bytes, args.raw_passes, threads_list, chunks)
    print(f"GB/s write / read, median of {args.raw_passes} pass(es)")
    print(f"{'threads':>8} " + " ".join(f"{f'{c} MB chunks':>15}" for c in chunks))
    for t in threads_list:
        print(f"{t:8d} " + " ".join(f"{raw[t, c].write:7.2f} / {raw[t, c].read:5.2f}" for c in chunks))
    if (DEFAULT_THREADS, DEFAULT_CHUNK_MB) in raw:
        at = raw[DEFAULT_THREADS, DEFAULT_CHUNK_MB]
        print(
            f"at the defaults ({DEFAULT_THREADS} threads, {DEFAULT_CHUNK_MB} MB): write "
            f"{at.write / disk.write:.2f}, read {at.read / disk.read:.2f} of the disk reference just before"
        )
    print("\n-- I/O-bound training steps, one option at a time --", flush=True)
    batches = make_batches(config.vocab_size, 2 + args.sweep_steps + 1, 1, EFFICIENCY_SEQ)
    train_sweep(model, batches, directory, cache, args.sweep_repeats, disk, threads_list, chunks)
    reference.measure(directory, args.disk_test_bytes, "after")
    print(f"disk reference over the sweep: {reference.describe()}")


# -- part 2: overlap --


def overlap(args: argparse.Namespace, directory: str) -> Run:
    print(
        "\n== overlap: the ~170M Llama, disk tier against plain Lightning and the disk's bound ==", flush=True
    )
    config = bench_config(args.quick)
    model = build_model(config)
    cache = store_bytes(model) * args.cache_fraction
    print(
        f"model: {describe_model(model, args.batch, args.seq)}; disk tier: max_cpu_gb {cache / GB:.3f} "
        f"({args.cache_fraction:.0%} of weights + Adam), slots {OVERLAP_SLOTS} blocks; "
        f"{args.warmup} warm-up + {args.steps} timed steps, {args.repeats} round-robin repeat(s); load "
        f"average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    batches = make_batches(config.vocab_size, args.warmup + args.steps + 1, args.batch, args.seq)
    reference = DiskReference()
    reference.measure(directory, args.disk_test_bytes, "before")
    trace = IOTrace()
    cases: list[tuple[str, Callable[[], MegaTrainStrategy | str]]] = [
        ("plain Lightning", lambda: "auto"),
        ("megatrain host tier, whole model in slots", lambda: megatrain(model)),
        (f"megatrain host tier, {OVERLAP_SLOTS} slots", lambda: megatrain(model, OVERLAP_SLOTS)),
        ("megatrain disk tier", lambda: megatrain(model, OVERLAP_SLOTS, directory, cache)),
        (
            "megatrain disk tier, act. ckpt",
            lambda: megatrain(model, OVERLAP_SLOTS, directory, cache, checkpointing=True),
        ),
    ]
    runs: list[Run] = []
    for repeat in range(args.repeats):
        print(f"repeat {repeat + 1}/{args.repeats}", flush=True)
        for i, (label, make) in enumerate(cases):
            run = timed_run(label, model, batches, args.warmup, make(), trace)
            if repeat == 0:
                runs.append(run)
            else:
                runs[i].absorb(run)
    plain, host, host_slots, disk, ckpt = runs
    reference.measure(directory, args.disk_test_bytes, "after")
    speed = reference.speed
    print(f"\ndisk reference: {reference.describe()}")
    print(
        f"\n{'run':<44} {'median s':>9} {'min s':>6} {'clean':>6} {'cpu s':>6} {'sys s':>6} {'new GB':>7} "
        f"{'other s':>8} {'/plain':>13} {'disk s':>7} {'/bound':>13}"
    )
    compute_median, compute_min = min(plain.median_s, host.median_s), min(plain.min_s, host.min_s)
    for r in runs:
        need = r.disk_time(speed)
        to_plain = f"{r.median_s / plain.median_s:.3f} {r.min_s / plain.min_s:.3f}"
        to_bound = f"{r.median_s / max(compute_median, need):.3f} {r.min_s / max(compute_min, need):.3f}"
        print(
            f"{r.label:<44} {r.median_s:9.3f} {r.min_s:6.2f} {f'{len(r.clean)}/{len(r.step_s)}':>6} "
            f"{statistics.median(r.cpu_s):6.2f} "
            f"{statistics.median(r.sys_s):6.2f} {r.faulted_gb:7.2f} {statistics.median(r.foreign_s):8.2f} "
            f"{to_plain:>13} {need:7.2f} {to_bound:>13}"
        )
    print(
        "(median over the clean steps, min over all pooled timed steps; ratios: of medians, then of minima; "
        "clean: steps during which other processes used under a tenth of a core; cpu s, sys s: process "
        "CPU time per step, all threads, and its system part; new GB: memory first touched per step "
        "(minor page faults); other s: CPU time the rest of the machine used per step)"
    )
    need = disk.disk_time(speed)
    for name, step in (("medians", Run.median_s.fget), ("minima", Run.min_s.fget)):
        compute = min(step(plain), step(host))
        to_plain, to_bound = step(disk) / step(plain), step(disk) / max(compute, need)
        print(
            f"\n{name}: disk tier (no act. ckpt) / plain = {to_plain:.3f} (goal <= {PLAIN_GOAL}: "
            f"{verdict(to_plain <= PLAIN_GOAL)}); / max(compute-only {compute:.3f} s, disk time "
            f"{need:.3f} s) = {to_bound:.3f} (goal <= {BOUND_GOAL}: {verdict(to_bound <= BOUND_GOAL)})"
        )
    print(
        "(compute-only: the faster of plain and the host tier with the whole model in slots; disk time: "
        "the run's store bytes at the disk's sequential GB/s)\n"
    )
    for r in (host, host_slots, disk, ckpt):
        engine_time(r)
    _, _, num_blocks = block_bytes(model)
    for r in (disk, ckpt):
        print(
            f"\n{r.label}: I/O in flight {r.busy['RW'] / r.wall_s:.0%} of the wall time; peak host cache "
            f"{r.peak_cache_bytes / GB:.3f} GB",
            end="",
        )
        traffic_table(r, num_blocks)
    print("\nstep times (s) and losses, all steps (max |diff| to plain):")
    for r in runs:
        diff = max(abs(a - b) for a, b in zip(r.losses, plain.losses, strict=True))
        print(f"  {r.label:<44} {seconds(r.step_s)}")
        print(f"  {'':<44} {' '.join(f'{x:.5f}' for x in r.losses)}   {diff:.3g}")
    return disk


# -- part 3: the DeepSpeed peer --


def peer(args: argparse.Namespace, directory: str, ours: Run | None) -> None:
    print("\n== peer: DeepSpeed ZeRO-3, parameters and optimizer state on NVMe ==", flush=True)
    if ours is None:
        config = bench_config(args.quick)
        model = build_model(config)
        batches = make_batches(config.vocab_size, args.warmup + args.steps + 1, args.batch, args.seq)
        strategy = megatrain(model, OVERLAP_SLOTS, directory, store_bytes(model) * args.cache_fraction)
        ours = timed_run("megatrain disk tier", model, batches, args.warmup, strategy)
        del model
        gc.collect()
    out = os.path.join(directory, "ds_peer.json")
    command = [sys.executable, PEER_SCRIPT, "--seq", str(args.seq), "--batch", str(args.batch)]
    command += ["--steps", str(args.steps * args.repeats), "--warmup", str(args.warmup), "--json", out]
    command += ["--nvme-dir", os.path.join(directory, "ds_nvme"), *(["--quick"] if args.quick else [])]
    command += ["--threads", str(args.threads)] if args.threads else []
    print("  " + " ".join(command), flush=True)
    proc = subprocess.run(command, capture_output=True, text=True)
    if not os.path.exists(out):
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        print(f"peer skipped (exit {proc.returncode}):\n{tail}")
        return
    with open(out) as f:
        ds = json.load(f)
    print(
        f"DeepSpeed {ds['deepspeed']} ({ds['optimizer']}): median step {ds['median_s']:.3f} s, min "
        f"{min(ds['step_s']):.3f} ({seconds(ds['step_s'])}), cpu {statistics.median(ds['cpu_s']):.2f} "
        f"s/step, initialize {ds['init_s']:.1f} s"
    )
    print(
        f"megatrain disk tier: median step {ours.median_s:.3f} s, min {ours.min_s:.3f} "
        f"({seconds(ours.step_s)}), cpu {statistics.median(ours.cpu_s):.2f} s/step"
    )
    for name, ratio in (
        ("medians", ds["median_s"] / ours.median_s),
        ("minima", min(ds["step_s"]) / ours.min_s),
    ):
        print(
            f"DeepSpeed / megatrain, {name} = {ratio:.2f} "
            f"(goal >= {PEER_GOAL}: {verdict(ratio >= PEER_GOAL)})"
        )
    print(f"losses, DeepSpeed: {' '.join(f'{x:.5f}' for x in ds['losses'])}")
    print(f"losses, megatrain: {' '.join(f'{x:.5f}' for x in ours.losses)}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated parts to run, of {','.join(PARTS)}"
    )
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="a folder on the disk to measure")
    parser.add_argument("--quick", action="store_true", help="small models and files: a smoke run")
    parser.add_argument("--seq", type=int, default=1024, help="overlap/peer: tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="overlap/peer: sequences per batch")
    parser.add_argument("--steps", type=int, default=3, help="overlap/peer: timed steps (per repeat)")
    parser.add_argument("--warmup", type=int, default=2, help="overlap/peer: untimed steps")
    parser.add_argument("--repeats", type=int, default=2, help="overlap: round-robin passes over the cases")
    parser.add_argument(
        "--cache-fraction", type=float, default=0.6, help="overlap/peer: max_cpu_gb / (weights + Adam state)"
    )
    parser.add_argument("--disk-test-gb", type=float, default=2.0, help="size of the fio/dd test file")
    parser.add_argument("--sweep-gb", type=float, default=1.0, help="bytes each raw I/O sweep trial moves")
    parser.add_argument("--sweep-steps", type=int, default=1, help="timed steps of each training sweep run")
    parser.add_argument("--raw-passes", type=int, default=2, help="passes of the raw I/O sweep")
    parser.add_argument(
        "--sweep-repeats", type=int, default=2, help="round-robin passes of the training sweep"
    )
    parser.add_argument("--sweep-threads", default="1,2,4,8", help="io_threads values to sweep")
    parser.add_argument("--sweep-chunks", default="1,4,8,32", help="io_chunk_mb values to sweep")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}")
    if args.quick:
        args.seq, args.steps, args.warmup, args.repeats = min(args.seq, 64), 2, 1, 1
        args.disk_test_gb, args.sweep_gb, args.raw_passes, args.sweep_repeats = 0.125, 0.03125, 1, 1
        args.sweep_threads, args.sweep_chunks = "1,4", "1,8"
    args.sweep_threads = [int(v) for v in args.sweep_threads.split(",")]
    args.sweep_chunks = [int(v) for v in args.sweep_chunks.split(",")]
    args.disk_test_bytes = int(args.disk_test_gb * GB)
    args.sweep_bytes = int(args.sweep_gb * GB)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    directory = tempfile.mkdtemp(prefix="bench_disk_", dir=args.dir)
    print(
        f"folder {directory} ({_filesystem(directory)}); "
        f"fio: {shutil.which('fio') or 'not installed, using dd'}"
    )
    check_direct(directory)
    try:
        ours = overlap(args, directory) if "overlap" in parts else None
        if "efficiency" in parts:
            efficiency(args, directory)
        if "sweep" in parts:
            sweep(args, directory)
        if "peer" in parts:
            peer(args, directory, ours)
        if "traffic" in parts:
            traffic(args, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")


def _filesystem(path: str) -> str:
    """The device and type of the filesystem holding ``path`` (from ``df``)."""
    out = subprocess.run(["df", "-T", path], capture_output=True, text=True).stdout.splitlines()
    return " ".join(re.split(r"\s+", out[-1])[:2]) if len(out) > 1 else "unknown"


if __name__ == "__main__":
    main()
