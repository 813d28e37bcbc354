"""Step time of the megatrain strategy against plain Lightning, side by side in one process.

The ~170M Llama (``llama_config("170m")``, built from config), fp32 (``"32-true"``; ``--precision
bf16-mixed`` runs every case in it), one batch of ``--batch`` x ``--seq`` random tokens per step, the
same initial weights and batches in every case:

- ``a``: plain Lightning (``strategy="auto"``) with ``torch.optim.AdamW(fused=True)``;
- ``b``: megatrain, slot budget >= the model (``model bytes * 1.1``), no activation checkpointing;
- ``c``: megatrain, a budget of two largest blocks, no activation checkpointing;
- ``d``: as ``c`` with activation checkpointing (recomputes each block: about 1/3 more compute);
- ``e``: as ``c`` with ``zero_copy=False``: on the CPU in fp32, ``b`` to ``d`` compute on the store's
  weights themselves (no slots, so the budget changes nothing there); ``e`` copies them into two slots,
  as a GPU would (not run unless named in ``--cases``);
- ``f``, ``g``: the disk tier (a store under a temporary folder, its default cache of the RAM) with a
  slot for every block and with two slots (what a CPU run gets by default), activation checkpointing
  on (not run unless named);
- ``h``: as ``d`` with a weight norm logged after each step the way users write one (autograd on, no
  ``detach``): the next step's backward never reaches it, so the updates still overlap the backward (not
  run unless named).

A step's time is the time from one ``on_train_batch_start`` to the next, so it includes block
updates that megatrain finishes after ``on_train_batch_end``; the first ``--warmup`` steps are
dropped, and one extra step is run to close the last timed one. The process CPU time per step
(all threads) is reported beside it. On a shared machine other processes slow the runs unevenly
(OpenMP threads that spin while a core is taken away lose the most), so each step also records the
CPU time the rest of the machine used meanwhile (``/proc/stat``), and medians are taken over the
clean steps, those where that stayed under ``FOREIGN_SHARE`` of one core (all steps, marked, if none).
``--repeats`` runs the cases round-robin that many times (so background load hits all alike) and
pools their steps. Run ``python benchmarks/bench_engine.py --quick`` for a smoke run on a small model.
"""

from __future__ import annotations

import argparse
import atexit
import copy
import gc
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.engine.blocks import discover_blocks
from megatrain_lightning.presets import llama_config

GOALS = {"b": 1.05, "c": 1.10}  # goal for the step-time ratio to the plain run
FOREIGN_SHARE = 0.1  # a step is clean if other processes used under this share of one core meanwhile
RATE_STATS = ("fetch_wait_s", "h2d_bytes", "h2d_s", "d2h_bytes", "optimizer_s", "optimizer_wait_s")


@dataclass(frozen=True)
class Case:
    """One configuration to time: ``budget`` is ``"model"``, ``"2blocks"`` or ``None`` (plain Lightning)."""

    key: str
    label: str
    budget: str | None = None
    activation_checkpointing: bool = False
    zero_copy: bool = True
    disk: bool = False
    weight_norm_logged: bool = False


CASES = {
    "a": Case("a", "plain Lightning"),
    "b": Case("b", "megatrain, budget 1.1 x model", "model"),
    "c": Case("c", "megatrain, budget 2 blocks", "2blocks"),
    "d": Case("d", "megatrain, budget 2 blocks, act. ckpt", "2blocks", activation_checkpointing=True),
    "e": Case("e", "megatrain, budget 2 blocks, slots", "2blocks", zero_copy=False),
    "f": Case("f", "megatrain disk tier, budget 1.1 x model", "model", True, disk=True),
    "g": Case("g", "megatrain disk tier, budget 2 blocks", "2blocks", True, disk=True),
    "h": Case("h", "as d, a weight norm logged", "2blocks", True, weight_norm_logged=True),
}


def machine_busy_s() -> float:
    """CPU seconds all processes have used since boot (``/proc/stat``; 0 where there is none)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user ... steal; guest is inside user


def _allowed(step_s: float) -> float:
    """Foreign CPU seconds a step of ``step_s`` may see and still be clean (at least two clock ticks)."""
    return max(FOREIGN_SHARE * step_s, 0.02)


@dataclass
class CaseResult:
    """Timed steps of one case, pooled over its repeats."""

    case: Case
    step_s: list[float] = field(default_factory=list)  # start-to-start time of each timed step
    cpu_s: list[float] = field(default_factory=list)  # process CPU time (all threads) of each timed step
    foreign_s: list[float] = field(default_factory=list)  # CPU time other processes used during each step
    in_step_s: list[float] = field(default_factory=list)  # batch start -> batch end
    losses: list[list[float]] = field(default_factory=list)  # per repeat, every step's loss
    num_slots: int | None = None
    stats: dict[str, float] = field(default_factory=dict)  # totals over the last repeat
    stats_timed: dict[str, float] = field(default_factory=dict)  # sums over all timed steps (RATE_STATS)

    @property
    def clean(self) -> list[int]:
        """Indices of the timed steps that other processes did not disturb."""
        return [
            i for i, (t, f) in enumerate(zip(self.step_s, self.foreign_s, strict=True)) if f <= _allowed(t)
        ]

    def median(self, values: list[float]) -> float:
        """Median of ``values`` (one per timed step) over the clean steps, or over all if none is clean."""
        clean = self.clean
        return statistics.median([values[i] for i in clean] if clean else values)

    @property
    def median_s(self) -> float:
        return self.median(self.step_s)

    @property
    def stats_per_step(self) -> dict[str, float]:
        return {k: v / len(self.step_s) for k, v in self.stats_timed.items()}


class BenchModule(L.LightningModule):
    """A Hugging Face causal LM: loss from its forward, AdamW(fused=True) over all parameters."""

    def __init__(self, model: PreTrainedModel, lr: float = 1e-4) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """A forward pass that keeps only the last position's logits (little compute besides the blocks)."""
        return self.model(input_ids=batch["input_ids"], use_cache=False, logits_to_keep=1).logits.argmax(-1)


class WeightNormLogger(Callback):
    """The norm of all weights, logged after each step as users write it (autograd on, no ``detach``)."""

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        pl_module.log("weight_norm", torch.stack([p.norm() for p in pl_module.parameters()]).norm())


class StepTimer(Callback):
    """Timestamps of each training batch's start and end; losses; engine counters. No gradient hook
    (``on_after_backward``, ``on_before_optimizer_step``): megatrain would defer every update to the step's
    end for it, as it does for users who read gradients there, and the common path would go unmeasured."""

    def __init__(self, sync_cuda: bool = False) -> None:
        self.sync_cuda = sync_cuda
        self.starts: list[float] = []
        self.cpu_starts: list[float] = []
        self.busy: list[float] = []  # CPU seconds the whole machine has used, at each batch start
        self.ends: list[float] = []
        self.losses: list[float] = []
        self.stats: list[dict[str, float]] = []  # engine counters at each batch start

    def _now(self) -> float:
        if self.sync_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.starts.append(self._now())
        self.cpu_starts.append(time.process_time())
        self.busy.append(machine_busy_s())
        if isinstance(trainer.strategy, MegaTrainStrategy):
            self.stats.append(trainer.strategy.stats.as_dict())

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.ends.append(self._now())
        self.losses.append(float(outputs["loss"]))


def bench_config(quick: bool, size: str = "170m") -> PretrainedConfig:
    """The benchmark model: a standard Llama shape, or a small one (hidden 256, 4 layers) if ``quick``."""
    if quick:
        return llama_config(
            "170m",
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=4096,
        )
    return llama_config(size)


def build_model(config: PretrainedConfig, seed: int = 0) -> PreTrainedModel:
    """The initial model, fp32, seeded; every case trains a deep copy of it."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return model


def make_batches(vocab_size: int, n: int, batch: int, seq: int, seed: int = 1) -> list[dict[str, Tensor]]:
    """``n`` batches of uniformly random tokens, labels equal to the inputs (HF shifts them)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab_size, (batch, seq), generator=gen)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def block_bytes(model: PreTrainedModel, itemsize: int = 4) -> tuple[int, int, int]:
    """``(model bytes, largest block bytes, number of blocks)`` as megatrain partitions ``model``."""
    blocks = discover_blocks(model)
    return sum(b.numel for b in blocks) * itemsize, max(b.numel for b in blocks) * itemsize, len(blocks)


def make_strategy(case: Case, model: PreTrainedModel) -> MegaTrainStrategy | str:
    if case.budget is None:
        return "auto"
    model_bytes, largest, _ = block_bytes(model)
    # A hair over two blocks, so that floating-point rounding of the GB figure cannot lose a slot.
    budget = model_bytes * 1.1 if case.budget == "model" else largest * 2 * 1.001
    return MegaTrainStrategy(
        max_vram_gb=budget / 1e9,
        activation_checkpointing=case.activation_checkpointing,
        zero_copy=case.zero_copy,
        offload_dir=_scratch_folder() if case.disk else None,
    )


def _scratch_folder() -> str:
    """A new folder for one disk-tier run's store, removed when the benchmark exits."""
    path = tempfile.mkdtemp(prefix="bench_engine-store-")
    atexit.register(shutil.rmtree, path, True)
    return path


def trainer_kwargs(accelerator: str, precision: str) -> dict[str, Any]:
    """A quiet one-device ``Trainer``: no logger, checkpoints, progress bar, summary or validation."""
    return dict(
        accelerator=accelerator,
        devices=1,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


def fit(
    model: PreTrainedModel,
    batches: Sequence[dict[str, Tensor]],
    strategy: MegaTrainStrategy | str,
    accelerator: str = "cpu",
    precision: str = "32-true",
    lr: float = 1e-4,
    callbacks: Sequence[Callback] = (),
) -> tuple[L.Trainer, StepTimer]:
    """Train ``model`` itself (not a copy) one step per batch under ``strategy``, with ``callbacks`` besides
    the timer; return trainer and timer."""
    free_earlier_runs()
    timer = StepTimer(sync_cuda=accelerator == "cuda")
    trainer = L.Trainer(
        strategy=strategy,
        max_steps=len(batches),
        callbacks=[timer, *callbacks],
        **trainer_kwargs(accelerator, precision),
    )
    trainer.fit(BenchModule(model, lr), train_dataloaders=DataLoader(list(batches), batch_size=None))
    return trainer, timer


def free_earlier_runs() -> None:
    """Collect what earlier runs left in reference cycles (a plain run's trainer holds its model, gradients
    and Adam state) before this one starts: freed later, they slowed the timed steps of whichever case
    came next by 15-20% (a, c, b against a, b, c: the same configuration 0.92 or 1.07 of plain)."""
    gc.collect()


def close(trainer: L.Trainer) -> None:
    """Wait for megatrain's pending updates and stop its threads; free what the run held."""
    strategy = trainer.strategy
    if isinstance(strategy, MegaTrainStrategy) and strategy.engine is not None:
        strategy.engine.close()
    gc.collect()


def run_case(
    result: CaseResult,
    model: PreTrainedModel,
    batches: Sequence[dict[str, Tensor]],
    warmup: int,
    accelerator: str = "cpu",
    precision: str = "32-true",
) -> None:
    """Train a deep copy of ``model`` on ``batches`` under ``result.case``; add the steps after ``warmup``."""
    strategy = make_strategy(result.case, model)
    callbacks = [WeightNormLogger()] if result.case.weight_norm_logged else []
    trainer, timer = fit(copy.deepcopy(model), batches, strategy, accelerator, precision, callbacks=callbacks)
    timed = range(warmup, len(batches) - 1)
    result.step_s += [timer.starts[i + 1] - timer.starts[i] for i in timed]
    result.cpu_s += [timer.cpu_starts[i + 1] - timer.cpu_starts[i] for i in timed]
    result.foreign_s += [
        (timer.busy[i + 1] - timer.busy[i]) - (timer.cpu_starts[i + 1] - timer.cpu_starts[i]) for i in timed
    ]
    result.in_step_s += [timer.ends[i] - timer.starts[i] for i in timed]
    result.losses.append(timer.losses)
    if isinstance(strategy, MegaTrainStrategy):
        assert strategy.engine is not None
        strategy.engine.wait_all()
        result.num_slots = strategy.engine.pager.num_slots
        result.stats = strategy.stats.as_dict()
        first, last = timer.stats[timed.start], timer.stats[timed.stop]
        for k in RATE_STATS:
            result.stats_timed[k] = result.stats_timed.get(k, 0.0) + last[k] - first[k]
    close(trainer)


def compare(
    config: PretrainedConfig,
    cases: str = "abcd",
    steps: int = 6,
    warmup: int = 2,
    batch: int = 1,
    seq: int = 256,
    repeats: int = 1,
    accelerator: str = "cpu",
    precision: str = "32-true",
) -> list[CaseResult]:
    """Run the ``cases`` (keys of :data:`CASES`) from the same weights and batches; print and return them."""
    model = build_model(config)
    model_bytes, largest, num_blocks = block_bytes(model)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {params / 1e6:.1f}M parameters, {model_bytes / 1e9:.3f} GB fp32, {num_blocks} blocks, "
        f"largest {largest / 1e6:.1f} MB; batch {batch} x {seq} tokens; {accelerator}, {precision}, "
        f"{torch.get_num_threads()} threads; {warmup} warm-up + {steps} timed steps, {repeats} repeat(s); "
        f"load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    batches = make_batches(config.vocab_size, warmup + steps + 1, batch, seq)
    results = [CaseResult(CASES[key]) for key in cases]
    for repeat in range(repeats):
        for result in results:
            print(f"repeat {repeat + 1}/{repeats}: {result.case.key} {result.case.label} ...", flush=True)
            run_case(result, model, batches, warmup, accelerator, precision)
    report(results, num_blocks)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    return results


def report(results: Sequence[CaseResult], num_blocks: int) -> None:
    """Print the step-time table, ratios to the plain run, loss agreement and engine counters."""
    base = next((r for r in results if r.case.budget is None), None)
    print(
        f"\n{'case':<42} {'median s':>9} {'min s':>7} {'cpu s':>7} {'in-step s':>10} "
        f"{'clean':>6} {'slots':>6} {'/plain':>7}  goal"
    )
    for r in results:
        ratio = r.median_s / base.median_s if base else float("nan")
        goal = GOALS.get(r.case.key)
        verdict = "" if goal is None else f"<= {goal:.2f} {'met' if ratio <= goal else 'NOT met'}"
        if goal is not None and base is not None and not (r.clean and base.clean):
            verdict = f"<= {goal:.2f} not judged: no clean steps"
        slots = "-" if r.num_slots is None else f"{r.num_slots}/{num_blocks}" if r.num_slots else "store"
        clean = f"{len(r.clean)}/{len(r.step_s)}"
        print(
            f"{r.case.key} {r.case.label:<40} {r.median_s:9.3f} {min(r.step_s):7.3f} "
            f"{r.median(r.cpu_s):7.3f} {r.median(r.in_step_s):10.3f} "
            f"{clean:>6} {slots:>6} {ratio:7.3f}  {verdict}"
        )
    if base is not None:
        print("\nratios to the plain run:  median  min  cpu")
        for r in results:
            if r is not base:
                fastest = min(r.step_s) / min(base.step_s)
                cpu = r.median(r.cpu_s) / base.median(base.cpu_s)
                print(f"  {r.case.key}/a: {r.median_s / base.median_s:.3f}  {fastest:.3f}  {cpu:.3f}")
    print("\nstep times in s (* disturbed: other processes used more than the allowed CPU meanwhile):")
    for r in results:
        clean = set(r.clean)
        steps = " ".join(f"{t:.3f}{'' if i in clean else '*'}" for i, t in enumerate(r.step_s))
        print(f"  {r.case.key}: {steps}")
    if base is not None:
        print("\nlosses (first repeat, all steps) and largest difference to the plain run over all repeats:")
        for r in results:
            diff = max(abs(x - y) for run in r.losses for x, y in zip(run, base.losses[0], strict=True))
            losses = " ".join(f"{x:.6f}" for x in r.losses[0])
            print(f"  {r.case.key}: {losses}   max |diff| {diff:.3g}")
    for r in results:
        if r.stats:
            print(f"\n{r.case.key} strategy.stats.as_dict() (whole last run): {_rounded(r.stats)}")
            print(f"{r.case.key} per timed step (all): {_rounded(r.stats_per_step)}")


def _rounded(stats: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in stats.items()}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per case and repeat")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per case before the timed ones")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1, help="round-robin runs of all cases, steps pooled")
    parser.add_argument("--size", default="170m", help="Llama shape for llama_config (ignored with --quick)")
    parser.add_argument("--cases", default="abcd", help="which cases to run, e.g. 'ac'")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed"))
    parser.add_argument(
        "--quick", action="store_true", help="small model (hidden 256, 4 layers): a smoke run"
    )
    args = parser.parse_args(argv)
    if unknown := set(args.cases) - set(CASES):
        parser.error(f"unknown cases {sorted(unknown)}; choose from {''.join(CASES)}")
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--steps and --repeats must be >= 1, --warmup >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    config = bench_config(args.quick, args.size)
    cases, steps, repeats = args.cases, args.steps, args.repeats
    compare(config, cases, steps, args.warmup, args.batch, args.seq, repeats, "cpu", args.precision)
    print(f"total wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
