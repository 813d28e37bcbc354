"""The headline, measured: a Llama-shaped model (1B, 3B, 7B) trains on this machine's disk within a small
RAM budget, beside what the planner predicted for the same settings.

One command per size (``--model 1b|3b|7b``). The parent process measures the disk (``dd``/fio, as
``bench_disk``) and the bf16 matmul speed, prints ``megatrain plan``'s figures for those speeds and the
run's budgets, runs the preflight (disk space for the store and the checkpoint, RAM for ``max_cpu_gb``),
then runs two children, each with a peak-RSS watcher thread:

- ``train``: ``CausalLMModule`` built in ``configure_model`` (streamed, block by block, into the disk
  store), ``offload_dir`` on the local disk, ``optimizer_compression="int4"``, ``bf16-mixed``, batch
  1 x ``--seq`` of the shipped corpus, ``--steps`` optimizer steps; a checkpoint after ``--steps - 2``
  (an epoch's end: ``limit_train_batches``), timed. Per step: time, loss, store bytes read and written
  (by file, from ``BlockFile`` calls), disk GB/s while busy, and the compute thread's stall share.
- ``resume``: a fresh process resumes from that checkpoint and runs the last two steps again; their
  losses must equal the first run's bitwise.

    python benchmarks/scale.py --model 1b --dir /work/scale_offload
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GB = 1e9
MODELS = ("170m", "1b", "3b", "7b")


# -- the child: one run, figures as JSON on the last line --


def watch_rss(peak: dict[str, int]) -> None:
    process = psutil.Process()

    def watch() -> None:
        while True:
            peak["rss"] = max(peak["rss"], process.memory_info().rss)
            time.sleep(0.005)

    threading.Thread(target=watch, daemon=True).start()
    time.sleep(0.05)


def child(args: argparse.Namespace) -> None:
    peak = {"rss": 0}
    watch_rss(peak)
    import lightning as L
    import torch
    from bench_disk import IOTrace

    from megatrain_lightning import MegaTrainStrategy
    from megatrain_lightning.data import TextDataModule
    from megatrain_lightning.models import CausalLMModule
    from megatrain_lightning.presets import llama_config
    from megatrain_lightning.telemetry.timeline import TIMELINE, render

    baseline = peak["rss"]
    config = llama_config(args.model)
    stats_keys = (
        "disk_read_bytes",
        "disk_write_bytes",
        "disk_read_s",
        "disk_write_s",
        "fetch_wait_s",
        "optimizer_wait_s",
        "offload_wait_s",
        "optimizer_s",
    )

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.steps: list[dict[str, Any]] = []
            self.first_batch = 0.0
            self.ends: list[float] = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            if not self.first_batch:
                self.first_batch = time.perf_counter()
                print(
                    f"[{args.phase}] init {self.first_batch - start:.1f} s, "
                    f"peak RSS {peak['rss'] / 2**30:.2f} GiB",
                    file=sys.stderr,
                    flush=True,
                )
                phases["init"], peak["rss"] = peak["rss"], 0
            elif trainer.global_step == save_at:  # after the checkpoint
                phases["checkpoint"], peak["rss"] = peak["rss"], 0
            self.t0 = time.perf_counter()
            self.s0 = {k: getattr(trainer.strategy.stats, k) for k in stats_keys}

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            t1 = time.perf_counter()
            if trainer.global_step == save_at:  # the checkpoint is saved next
                phases["train"], peak["rss"] = max(phases["train"], peak["rss"]), 0
            stats = trainer.strategy.stats
            step = {k: getattr(stats, k) - self.s0[k] for k in stats_keys}
            step |= {
                "step": trainer.global_step,
                "s": t1 - self.t0,
                "loss": float(outputs["loss"]),
                "busy_read_s": trace.busy_s("R", self.t0, t1),
                "busy_write_s": trace.busy_s("W", self.t0, t1),
                "busy_s": trace.busy_s("RW", self.t0, t1),
                "files": {f"{op} {kind}": b for (op, kind), (_, b) in trace.by_kind(self.t0, t1).items()},
                "start": self.t0,
            }
            self.steps.append(step)
            self.ends.append(t1)
            print(
                f"[{args.phase}] step {step['step']}: {step['s']:.1f} s, loss {step['loss']:.4f}, read "
                f"{step['disk_read_bytes'] / GB:.2f} GB, write {step['disk_write_bytes'] / GB:.2f} GB, "
                f"peak RSS {peak['rss'] / 2**30:.2f} GiB",
                file=sys.stderr,
                flush=True,
            )

    class TimelineDump(L.Callback):
        """The engine's spans (fetch, compute, offload, optimizer, disk) of one optimizer step, as JSON
        (seconds from the step's start) and a PNG in the working folder (the run's folders are removed)."""

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            if trainer.global_step == args.timeline_step:
                TIMELINE.start()
                self.origin = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if trainer.global_step != args.timeline_step + 1 or not TIMELINE.enabled:
                return
            events = TIMELINE.stop()
            path = f"timeline_step{args.timeline_step}"
            spans = [(e.lane, e.start - self.origin, e.end - self.origin) for e in events]
            with open(path + ".json", "w") as f:
                json.dump(spans, f)
            render(events, path + ".png", origin=self.origin, title=f"step {args.timeline_step}")

    phases = {"init": 0, "train": 0, "checkpoint": 0}  # peak RSS of each phase
    clock = Clock()
    ckpt_dir = os.path.join(args.ckpt_dir, "checkpoints")
    save_at = args.steps - 2
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=ckpt_dir, every_n_train_steps=save_at, save_top_k=-1, save_last=False
    )
    strategy = MegaTrainStrategy(
        offload_dir=args.dir,
        max_cpu_gb=args.max_cpu_gb,
        max_vram_gb=args.max_vram_gb,  # two slots of the largest block in bf16 (RAM buffers on the CPU)
        optimizer_compression="int4",
        io_threads=args.io_threads,
    )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=args.steps,
        limit_train_batches=save_at,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock, checkpoints, *([TimelineDump()] if args.timeline_step is not None else [])],
    )
    module = CausalLMModule(config, lr=args.lr, warmup_steps=1, max_steps=args.steps)
    resume = None
    if args.phase == "resume":
        resume = os.path.join(ckpt_dir, f"epoch=0-step={save_at}.ckpt")
    torch.manual_seed(0)
    trace = IOTrace()
    start = time.perf_counter()
    with trace.active():
        trainer.fit(module, datamodule=TextDataModule(seq_len=args.seq, batch_size=1), ckpt_path=resume)
    print(
        json.dumps(
            {
                "baseline_rss": baseline,
                "peak_rss": max(peak["rss"], *phases.values()),
                "phases": phases | {"train": max(phases["train"], peak["rss"])},
                "init_s": clock.first_batch - start,
                "steps": clock.steps,
                "ends": clock.ends,
                "fit_s": time.perf_counter() - start,
                "disk_peak_bytes": disk_peak["bytes"],
                "cache_peak": strategy.stats.peak_host_cache_bytes,
            }
        )
    )


disk_peak = {"bytes": 0}


def watch_disk(paths: list[str]) -> None:
    """Peak bytes allocated under ``paths`` (the store's preallocated files and the checkpoint)."""

    def used() -> int:
        total = 0
        for root, _, files in (entry for path in paths for entry in os.walk(path)):
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    total += os.stat(os.path.join(root, name)).st_blocks * 512
        return total

    def watch() -> None:
        while True:
            disk_peak["bytes"] = max(disk_peak["bytes"], used())
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True).start()


# -- the parent: machine speeds, plan, preflight, children, report --


def matmul_tflops(hidden: int, mlp: int, tokens: int) -> float:
    """bf16 TFLOP/s of this machine on a layer's largest matmul (``tokens x hidden @ hidden x mlp``)."""
    import torch

    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    w = torch.randn(hidden, mlp, dtype=torch.bfloat16)
    for _ in range(3):
        x @ w
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10):
            x @ w
        runs.append((time.perf_counter() - t0) / 10)
    return 2 * tokens * hidden * mlp / statistics.median(runs) / 1e12


def update_rates(numel: int = 1 << 24) -> tuple[float, float]:
    """G parameters per second of the host's AdamW on one thread, as the engine's optimizer worker runs it
    beside compute on the CPU (``engine/threads.py``): the int4 kernel (the decoder layers' large
    parameters) and torch's AdamW with fp32 moments (embeddings, head, norms; ``foreach`` off, torch's
    default on the CPU)."""
    import torch

    from megatrain_lightning.optim import codecs
    from megatrain_lightning.optim.quantized import quantized_adamw_

    param, grad = torch.randn(numel), torch.randn(numel)
    state = codecs.empty_state(numel, 4)
    hparams = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    fp32 = torch.nn.Parameter(torch.randn(numel))
    fp32.grad = torch.randn(numel)
    adamw = torch.optim.AdamW([fp32], lr=1e-4, foreach=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rates = []
        for step_once in (
            lambda step: quantized_adamw_(param, grad, *state, bits=4, step=step, num_threads=1, **hparams),
            lambda step: adamw.step(),
        ):
            runs = []
            for step in range(1, 6):
                t0 = time.perf_counter()
                step_once(step)
                runs.append(time.perf_counter() - t0)
            rates.append(numel / statistics.median(runs[1:]) / 1e9)
    finally:
        torch.set_num_threads(threads)
    return rates[0], rates[1]


def plan_figures(
    args: argparse.Namespace, disk_gbps: float, tflops: float, rates: tuple[float, float]
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from megatrain_lightning.engine.blocks import discover_blocks
    from megatrain_lightning.engine.slots import mixed_fp32_numels
    from megatrain_lightning.planner.plan import (
        RESERVE,
        Machine,
        ModelShape,
        Workload,
        activation_bytes,
        disk_traffic,
        plan_for,
    )
    from megatrain_lightning.planner.table import format_plan
    from megatrain_lightning.planner.traffic import least_disk_traffic
    from megatrain_lightning.presets import llama_config
    from megatrain_lightning.store import sizing

    config = llama_config(args.model)
    with torch.device("meta"):
        blocks = discover_blocks(AutoModelForCausalLM.from_config(config))
    # bf16-mixed: the blocks' fp32 parts (the embedding, the norms) stay fp32 in the slots
    shape = ModelShape.from_blocks([b.numel for b in blocks], config, mixed_fp32_numels(blocks))
    workload = Workload(tokens_per_step=args.seq, compute_dtype="bf16")
    # Two slots of the largest block: the largest (the fp32 embedding of a 7B) and any other one at once,
    # so a decoder layer loads while another computes. (Two slots of a bf16 layer's size, as sized before,
    # held the 7B's embedding and no second slot for the layers: each loaded after the last had computed.)
    slots = 2 * max(shape.block_bytes(2))
    act = activation_bytes(shape, args.seq, 2)
    # The host's AdamW over the model: the quantized parameters at the kernel's rate, the rest at torch's.
    quantized = sum(b.large_numel for b in blocks if b.repeated)
    update_s = quantized / (rates[0] * GB) + (shape.num_params - quantized) / (rates[1] * GB)
    # The run's budgets as the planner's machine: RAM = max_cpu_gb, "GPU" = two slots (RAM here too).
    machine = Machine(
        vram_gb=(slots + act) / GB / (1 - RESERVE) * 1.001,
        ram_gb=args.max_cpu_gb / (1 - RESERVE),
        disk_gb=shutil.disk_usage(args.dir_parent).free / GB,
        pcie_gbps=1000.0,  # no link on the CPU: slots are RAM
        disk_gbps=disk_gbps,
        tflops=tflops,
        update_gparams=shape.num_params / update_s / GB,
    )
    plan = plan_for(shape, machine, "int4", workload)
    print(format_plan(plan), flush=True)
    row = plan.row("megatrain int4")
    cache = row.settings.cache_gb * GB if row.settings else args.max_cpu_gb * GB
    # The least traffic as the planner counts it, with the store's exact bytes (embeddings, head and small
    # parameters keep fp32 moments).
    least = least_disk_traffic(
        sizing.region_bytes(blocks), sizing.state_bytes(blocks, "int4"), cache, 1, 4 * shape.largest_block
    )
    grads = 2 * shape.largest_block  # one block's gradients in bf16 on the CPU "device"
    return {
        "rss_growth": row.host_gb * GB + row.gpu_gb * GB + grads,
        "cache": cache,
        "slots": slots,
        "files": sizing.disk_files_bytes(blocks, "int4", gradients=False),
        "checkpoint": sizing.region_bytes(blocks) + sizing.state_bytes(blocks, "int4"),
        "step_s": row.step_s,
        "bound_by": row.bound_by,
        "compute_s": 6 * shape.num_params * args.seq / (tflops * 1e12),
        "disk_s": sum(disk_traffic(shape, "int4", 1, cache)) / (disk_gbps * GB),
        "update_s": update_s,
        "least_disk_s": (least.reads + least.writes) / (disk_gbps * GB),
        "reads": least.reads,
        "writes": least.writes,
        "least": dataclasses.asdict(least),
        "params": shape.num_params,
        "min_cache": sizing.min_cache_bytes(shape.largest_block, cuda=False),
    }


def run_child(args: argparse.Namespace, phase: str) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", phase, "--model", args.model]
    cmd += [
        "--dir",
        args.dir,
        "--ckpt-dir",
        args.ckpt_dir,
        "--steps",
        str(args.steps),
        "--seq",
        str(args.seq),
    ]
    cmd += [
        "--max-cpu-gb",
        str(args.max_cpu_gb),
        "--lr",
        str(args.lr),
        "--max-vram-gb",
        str(args.max_vram_gb),
        "--io-threads",
        str(args.io_threads),
    ]
    if args.timeline_step is not None and phase == "train":
        cmd += ["--timeline-step", str(args.timeline_step)]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # progress on stderr as it happens
    if out.returncode != 0:
        print(out.stdout[-3000:])
        raise SystemExit(f"the {phase} run failed")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(
    args: argparse.Namespace, plan: dict[str, Any], run: dict[str, Any], resumed: dict[str, Any]
) -> None:
    steps = run["steps"]
    steady = steps[1:] or steps  # the first step records the trace
    print(
        f"\n== {args.model}: {plan['params'] / 1e9:.2f} B params, max_cpu_gb={args.max_cpu_gb}, int4, "
        f"bf16-mixed, batch 1 x {args.seq}"
    )
    grown = run["phases"]["train"] - run["baseline_rss"]
    print("peak RSS by phase: " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in run["phases"].items()))
    print(
        f"peak RSS {run['peak_rss'] / 2**30:.2f} GiB (baseline {run['baseline_rss'] / 2**30:.2f} GiB, growth "
        f"{grown / GB:.2f} GB in training; planner: growth {plan['rss_growth'] / GB:.2f} GB = cache "
        f"{plan['cache'] / GB:.2f} + slots and activations + one block's gradients); "
        f"cache peak {run['cache_peak'] / GB:.2f} GB; "
        f"least max_cpu_gb {plan['min_cache'] / GB:.2f} GB"
    )
    print(
        f"disk peak {run['disk_peak_bytes'] / GB:.1f} GB (store + checkpoint; planner: store "
        f"{plan['files'] / GB:.1f} + checkpoint {plan['checkpoint'] / GB:.1f} GB)"
    )
    print(f"init (configure_model on meta + store filled block by block + setup) {run['init_s']:.1f} s")
    print(
        f"\n{'step':>4} {'s':>7} {'loss':>8} {'read GB':>8} {'write GB':>8} {'R GB/s':>6} {'W GB/s':>6} "
        f"{'disk busy':>9} {'stall':>6} {'adam s':>6}"
    )
    for s in steps:
        stall = (s["fetch_wait_s"] + s["optimizer_wait_s"] + s["offload_wait_s"]) / s["s"]
        rr = s["disk_read_bytes"] / s["busy_read_s"] / GB if s["busy_read_s"] else 0.0
        wr = s["disk_write_bytes"] / s["busy_write_s"] / GB if s["busy_write_s"] else 0.0
        print(
            f"{s['step']:>4} {s['s']:7.1f} {s['loss']:8.4f} {s['disk_read_bytes'] / GB:8.2f} "
            f"{s['disk_write_bytes'] / GB:8.2f} {rr:6.2f} {wr:6.2f} {s['busy_s'] / s['s']:9.0%} {stall:6.0%} "
            f"{s['optimizer_s']:6.1f}"
        )
    median = statistics.median(s["s"] for s in steady)
    print(
        f"\nstep time (median of steps 2..): {median:.1f} s; planner bound {plan['step_s']:.1f} s "
        f"({plan['bound_by']}; compute {plan['compute_s']:.1f} s, disk {plan['disk_s']:.1f} s, update "
        f"{plan['update_s']:.1f} s): "
        f"{median / plan['step_s']:.2f}x"
    )
    files: dict[str, float] = {}
    for s in steady:
        for key, b in s["files"].items():
            files[key] = files.get(key, 0) + b / len(steady)
    print(
        "store traffic per step by file (steps 2..): "
        + ", ".join(f"{k}.bin {v / GB:.2f} GB" for k, v in sorted(files.items()))
    )
    reads = sum(v for k, v in files.items() if k.startswith("R"))
    writes = sum(v for k, v in files.items() if k.startswith("W"))

    def against(moved: float, least: float) -> str:
        ratio = f"{moved / least:.2f}x" if least else "none needed"  # a store the cache holds whole
        return f"{moved / GB:.2f} GB (least {least / GB:.2f}: {ratio})"

    print(f"read {against(reads, plan['reads'])}, write {against(writes, plan['writes'])}")
    least = ", ".join(f"{k} {v / GB:.2f} GB" for k, v in plan["least"].items())
    print(f"least by what the files hold: {least}")
    ends = run["ends"]
    save_at = args.steps - 2
    save_s = steps[save_at]["start"] - ends[save_at - 1]
    print(f"checkpoint after step {save_at}: {save_s:.1f} s (save + epoch end)")
    first = {s["step"]: s["loss"] for s in steps}
    again = {s["step"]: s["loss"] for s in resumed["steps"]}
    same = all(first[k] == v for k, v in again.items()) and len(again) == 2
    print(
        f"resumed steps {sorted(again)}: losses {[again[k] for k in sorted(again)]} vs "
        f"{[first[k] for k in sorted(again)]}: {'bitwise equal' if same else 'DIFFERENT'}; resume init "
        f"{resumed['init_s']:.1f} s, peak RSS {resumed['peak_rss'] / 2**30:.2f} GiB"
    )
    losses = [s["loss"] for s in steps]
    print(
        f"losses finite: {all(map(lambda x: x == x and abs(x) < 1e9, losses))}, last below first: "
        f"{losses[-1] < losses[0]}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=MODELS, default="1b")
    parser.add_argument(
        "--dir",
        default=os.path.join(tempfile.gettempdir(), "megatrain_scale"),
        help="offload_dir (on the local disk); removed afterwards",
    )
    parser.add_argument("--ckpt-dir", default=None, help="where the checkpoint goes (default: beside --dir)")
    parser.add_argument(
        "--steps", type=int, default=6, help="optimizer steps; the checkpoint is after steps - 2"
    )
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--max-cpu-gb", type=float, default=5.0)
    parser.add_argument(
        "--lr",
        type=float,
        default=3e-5,
        help="peak lr (one warmup step, cosine to 0): Adam's first step moves every weight by about lr, and "
        "at 3e-4 the wide models' loss rises in these few steps (RESULTS.md, Scale)",
    )
    parser.add_argument(
        "--io-threads", type=int, default=4, help="the strategy's io_threads (disk reads and writes at once)"
    )
    parser.add_argument(
        "--timeline-step",
        type=int,
        help="record the engine's spans of this optimizer step (0-based) into timeline_step<N>.json and "
        ".png in the working folder",
    )
    parser.add_argument("--max-vram-gb", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--phase", choices=("train", "resume"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.ckpt_dir = args.ckpt_dir or args.dir + "_ckpt"
    if args.phase is not None:
        watch_disk([args.dir, args.ckpt_dir])
        child(args)
        return
    from bench_disk import measure_disk

    from megatrain_lightning.store.preflight import check_disk_space, check_host_ram

    if args.steps < 5:
        raise SystemExit("--steps must be at least 5")
    os.makedirs(args.dir, exist_ok=True)
    args.dir_parent = args.dir
    speeds = measure_disk(args.dir, 2 << 30)
    read = max(s.read for s in speeds.values())
    write = max(s.write for s in speeds.values())
    disk_gbps = 2 / (1 / read + 1 / write)  # reads and writes share the disk
    print(f"disk: read {read:.2f} GB/s, write {write:.2f} GB/s ({', '.join(speeds)})", flush=True)
    from megatrain_lightning.presets import llama_config

    config = llama_config(args.model)
    tflops = matmul_tflops(config.hidden_size, config.intermediate_size, args.seq)
    print(
        f"bf16 matmul {tflops:.3f} TFLOP/s ({args.seq} x {config.hidden_size} @ {config.intermediate_size})"
    )
    rates = update_rates()
    print(f"AdamW on one thread: int4 kernel {rates[0]:.3f}, torch fp32 {rates[1]:.3f} G params/s")
    plan = plan_figures(args, disk_gbps, tflops, rates)
    args.max_vram_gb = plan["slots"] * 1.01 / GB
    check_host_ram(args.max_cpu_gb)
    check_disk_space(args.dir, plan["files"] + plan["checkpoint"])
    try:
        run = run_child(args, "train")
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir, exist_ok=True)
        resumed = run_child(args, "resume")
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
        shutil.rmtree(args.ckpt_dir, ignore_errors=True)
    report(args, plan, run, resumed)
    print(json.dumps({"plan": plan, "run": run, "resumed": resumed}))


if __name__ == "__main__":
    main()
