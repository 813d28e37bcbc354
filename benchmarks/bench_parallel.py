"""Data parallel: one rank against two, side by side in one run (issue 16); on the CPU (gloo, forked ranks)
or with ``--accelerator cuda`` on two GPUs (NCCL gathers and reduce-scatters, spawned ranks).

The same Llama (``--size`` preset, or a small one with ``--quick``), in ``--precision`` (fp32 by
default), trains on one rank with ``2 x --batch`` rows per step and on two forked ranks with ``--batch``
rows each: the same global batch (the one-rank run is fed the rows in the order Lightning's
``DistributedSampler`` deals them to the ranks). Per rank and timed step it reports what the rank's
collectives received (``stats.gathered_bytes``, ``stats.reduce_scattered_bytes``) against the least a
sharded step needs: every block gathered for its forward and again for its backward, its gradients
reduce-scattered once, of which a rank receives (world - 1)/world of the model's bytes in the dtype moved
(the gathers in the dtypes the blocks compute in, bf16 weights under bf16-mixed; the gradients in fp32);
the store bytes each rank holds against the one rank's; the losses' agreement; and step times (two ranks
on a 2-core machine share its cores: a CPU run shows the bytes, not a speed-up). ``--on-demand`` also
runs two ranks that gather each block only when it is needed (``prefetch_depth=0``): the step-time ratio
shows what gathering ahead along the trace buys. ``benchmarks/gpu_check.py``'s ``parallel`` part runs the
same comparison on two GPUs. ``python benchmarks/bench_parallel.py --quick`` is a smoke run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from bench_engine import BenchModule, bench_config, block_bytes, build_model, trainer_kwargs
from torch.utils.data import DataLoader
from transformers import PreTrainedModel

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.engine.blocks import discover_blocks
from megatrain_lightning.engine.slots import SlotLayout

WORLD = 2


class RankReport(L.Callback):
    """Per rank: each training batch's start time and collective bytes, the losses reduced over the ranks,
    and at the end the store's bytes, written to ``out/rank<r>.json``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.starts: list[float] = []
        self.moved: list[tuple[int, int]] = []  # (gathered, reduce-scattered) at each batch start and the end
        self.losses: list[float] = []

    def _moved(self, trainer: L.Trainer) -> tuple[int, int]:
        stats = trainer.strategy.stats
        return stats.gathered_bytes, stats.reduce_scattered_bytes

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.starts.append(time.perf_counter())
        self.moved.append(self._moved(trainer))

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any
    ) -> None:
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.starts.append(time.perf_counter())
        self.moved.append(self._moved(trainer))
        report = {
            "starts": self.starts,
            "moved": self.moved,
            "losses": self.losses,
            "store_bytes": trainer.strategy.engine.store.nbytes(),
            "gathers_ahead": trainer.strategy.stats.gathers_ahead,
            "world": trainer.world_size,
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def rows(vocab: int, n: int, seq: int) -> list[dict[str, torch.Tensor]]:
    """``n`` rows of uniformly random tokens, labels equal to the inputs (Hugging Face shifts them)."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (seq,), generator=generator)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def dealt_order(n: int) -> list[int]:
    """The permutation Lightning's ``DistributedSampler`` deals training rows from in the first epoch
    (seeded by ``PL_GLOBAL_SEED``); rank ``r`` takes every ``WORLD``-th row from ``r`` on."""
    seed = int(os.getenv("PL_GLOBAL_SEED", 0))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def train(
    model: PreTrainedModel,
    data: list[dict[str, torch.Tensor]],
    batch: int,
    ranks: int,
    out: Path,
    precision: str,
    accelerator: str = "cpu",
    **options: Any,
) -> None:
    """Fit a copy of ``model`` on ``ranks`` ranks, one step per ``batch`` rows of each rank (forked on the
    CPU; spawned on CUDA, which a forked process cannot use once its parent has); ``options``: the
    strategy's."""
    out.mkdir(parents=True, exist_ok=True)
    start_method = "fork" if accelerator == "cpu" else "spawn"
    strategy = MegaTrainStrategy(start_method=start_method, timeout=timedelta(minutes=5), **options)
    quiet = {**trainer_kwargs(accelerator, precision), "devices": ranks}
    trainer = L.Trainer(
        strategy=strategy, max_steps=len(data) // (batch * ranks), callbacks=[RankReport(out)], **quiet
    )
    torch.manual_seed(1)
    trainer.fit(BenchModule(copy.deepcopy(model)), train_dataloaders=DataLoader(data, batch_size=batch))


def compute_bytes(model: PreTrainedModel, precision: str) -> int:
    """The model's bytes in the dtypes its blocks compute in (what a gather moves)."""
    blocks = discover_blocks(model)
    mixed = precision == "bf16-mixed"
    layout = SlotLayout(blocks, torch.bfloat16 if mixed else torch.float32, mixed=mixed)
    return sum(p.numel * layout.dtypes[b.index][i].itemsize for b in blocks for i, p in enumerate(b.params))


def per_step(report: dict[str, Any], warmup: int) -> dict[str, float]:
    """Medians over the timed steps: seconds, bytes gathered and reduce-scattered."""
    starts, moved = report["starts"], report["moved"]
    timed = range(warmup, len(starts) - 1)
    return {
        "step_s": statistics.median(starts[i + 1] - starts[i] for i in timed),
        "gathered": statistics.median(moved[i + 1][0] - moved[i][0] for i in timed),
        "reduce_scattered": statistics.median(moved[i + 1][1] - moved[i][1] for i in timed),
    }


@dataclass
class Comparison:
    """One rank against ``WORLD``: per-step medians and what each rank held and moved."""

    model_bytes: int
    gather_least: float  # bytes a rank receives at least per gather of the whole model (compute dtypes)
    reduce_least: float  # ... per reduce-scatter of the fp32 gradients
    one: dict[str, Any]  # the one-rank run's report
    ranks: list[dict[str, Any]]  # each rank's report
    demand: list[dict[str, Any]]  # each rank's report of the run that gathers on demand (if it ran)
    warmup: int

    def step(self, report: dict[str, Any]) -> dict[str, float]:
        return per_step(report, self.warmup)

    @property
    def loss_diff(self) -> float:
        """The largest relative difference of the losses (the ranks' mean) from the one rank's."""
        pairs = zip(self.one["losses"], self.ranks[0]["losses"], strict=True)
        return max(abs(a - b) / abs(a) for a, b in pairs)

    def gathered_ratio(self, report: dict[str, Any]) -> float:
        return self.step(report)["gathered"] / (2 * self.gather_least)

    def reduced_ratio(self, report: dict[str, Any]) -> float:
        return self.step(report)["reduce_scattered"] / self.reduce_least

    def store_ratio(self, report: dict[str, Any]) -> float:
        return report["store_bytes"] / self.one["store_bytes"]


def compare(
    config: Any,
    batch: int,
    seq: int,
    steps: int,
    warmup: int,
    precision: str,
    accelerator: str = "cpu",
    on_demand: bool = False,
    log: Callable[[str], None] = print,
    header: Callable[[int], None] = lambda model_bytes: None,
) -> Comparison:
    """Train ``config``'s model on one rank and on ``WORLD`` ranks (the same global batches); ``on_demand``:
    also on ``WORLD`` ranks that gather no block ahead (``prefetch_depth=0``)."""
    model = build_model(config)
    model_bytes, _, _ = block_bytes(model)
    header(model_bytes)
    data = rows(config.vocab_size, (warmup + steps) * batch * WORLD, seq)
    with tempfile.TemporaryDirectory() as folder:
        log("one rank ...")
        ordered = [data[i] for i in dealt_order(len(data))]
        train(model, ordered, WORLD * batch, 1, Path(folder, "one"), precision, accelerator)
        backend = "gloo, forked" if accelerator == "cpu" else "NCCL, spawned"
        log(f"{WORLD} ranks ({backend}) ...")
        train(model, data, batch, WORLD, Path(folder, "two"), precision, accelerator)
        if on_demand:
            log(f"{WORLD} ranks gathering on demand ...")
            train(model, data, batch, WORLD, Path(folder, "demand"), precision, accelerator, prefetch_depth=0)
        one, two, demand = (
            [json.loads(path.read_text()) for path in sorted(Path(folder, run).glob("rank*.json"))]
            for run in ("one", "two", "demand")
        )
    share = (WORLD - 1) / WORLD  # what a rank receives of one gather (or reduce-scatter) of all
    return Comparison(
        model_bytes, compute_bytes(model, precision) * share, model_bytes * share, one[0], two, demand, warmup
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="170m", help="Llama shape for llama_config (ignored with --quick)")
    parser.add_argument(
        "--quick", action="store_true", help="small model (hidden 256, 4 layers): a smoke run"
    )
    parser.add_argument("--batch", type=int, default=1, help="rows per rank and step (one rank: twice that)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda"], help="cuda: NCCL, 2 GPUs")
    parser.add_argument(
        "--on-demand", action="store_true", help="also two ranks gathering each block only when needed"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    config = bench_config(args.quick, args.size)
    result = compare(
        config, args.batch, args.seq, args.steps, args.warmup, args.precision, args.accelerator,
        on_demand=args.on_demand, log=lambda line: print(line, flush=True),
        header=lambda model_bytes: print(
            f"model: {model_bytes / 4 / 1e6:.1f}M parameters, {model_bytes / 1e9:.3f} GB fp32; "
            f"{args.warmup} warm-up + {args.steps} timed steps of {WORLD * args.batch} x {args.seq} tokens; "
            f"{torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.2f}",
            flush=True,
        ),
    )  # fmt: skip
    print(
        f"\nleast a rank receives per step: gathers 2 x {result.gather_least / 1e9:.4f} GB, "
        f"reduce-scatter {result.reduce_least / 1e9:.4f} GB"
    )
    print(f"{'run':<18} {'step s':>7} {'gathered GB':>12} {'/ least':>8} {'reduced GB':>11} {'/ least':>8} "
          f"{'store GB':>9} {'/ one rank':>10} {'ahead':>6}")  # fmt: skip
    print(f"{'one rank':<18} {result.step(result.one)['step_s']:7.3f} {0:12.4f} {'-':>8} {0:11.4f} {'-':>8} "
          f"{result.one['store_bytes'] / 1e9:9.4f} {1:10.3f} {'-':>6}")  # fmt: skip
    runs = [("", result.ranks)] + ([("on demand ", result.demand)] if result.demand else [])
    for label, reports in runs:
        for rank, report in enumerate(reports):
            s = result.step(report)
            print(
                f"{f'{label}rank {rank}':<18} {s['step_s']:7.3f} "
                f"{s['gathered'] / 1e9:12.4f} {result.gathered_ratio(report):8.3f} "
                f"{s['reduce_scattered'] / 1e9:11.4f} {result.reduced_ratio(report):8.3f} "
                f"{report['store_bytes'] / 1e9:9.4f} {result.store_ratio(report):10.3f} "
                f"{report['gathers_ahead']:6d}"
            )
    if result.demand:
        ratio = result.step(result.ranks[0])["step_s"] / result.step(result.demand[0])["step_s"]
        print(f"\nstep time, gathered ahead / on demand (rank 0): {ratio:.3f}")
    print(f"\nlosses, one rank:  {' '.join(f'{x:.6f}' for x in result.one['losses'])}")
    print(
        f"losses, {WORLD} ranks: {' '.join(f'{x:.6f}' for x in result.ranks[0]['losses'])}   "
        f"max rel. diff {result.loss_diff:.2g}"
    )
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
