"""Final validation loss of compressed optimizer state against fp32 state, on real text.

Run (the acceptance grid of issue 15: about 8 minutes on one H200 with a 16-core host, 30 runs 15 at a
time; days on a 2-core machine)::

    python benchmarks/convergence.py --corpus stdlib --batch 32 --seq 128 --steps 1000 --eval-every 100 \\
        --lrs 1e-3 3e-3 1e-2 --seeds 0 1 --modes none int8 int4 int3 int2 \\
        --device cuda --matmul-precision high --threads 1 --jobs 15

Text: the Python standard library's own ``.py`` files (``realtext.py``: byte-level, every 10th file
held out for validation) or the corpus shipped with the package (``--corpus shipped``: its last 5%
held out). Model: a byte-level Llama (``--hidden``/``--layers``; the defaults give 25M parameters).
Schedule: linear warmup then cosine to 0; AdamW betas (0.9, 0.95), weight decay 0.1 on matrices (the
project's ``CausalLMModule`` recipe); ``--clip`` clips the gradients' global norm first.

The model trains in a plain torch loop and the optimizer is driven directly: what is measured is
CPUAdamW's arithmetic, i.e. per parameter either torch's fused AdamW on fp32 moments or the fused
quantized step (``optim/quantized.py``), with CPUAdamW's policy of which parameters get compressed
state (the >= 4096-element tensors of the decoder layers; embeddings, head and norms keep fp32). The
paging engine around it is bitwise neutral (tested elsewhere) and only slower, so it is left out.
``--device cuda`` computes the model on a GPU (the optimizer stays on the CPU, over fp32 masters): the
grid at a larger batch in minutes instead of days. ``--jobs`` runs that many runs at once, each in its own
process (on a GPU they share it).

Every (lr, seed) pair starts all modes from the same weights and feeds them the same batches. Reported:
the final validation loss (``--val-batches`` fixed held-out batches, the curve's) per mode and its change
against fp32 state, beside fp32's seed-to-seed spread; and the change on the whole held-out split with the
part of it that the validation sample alone explains (``held_out_report``). Results go to ``--json`` and
the curves to ``--out``. ``--report a.json b.json`` merges earlier results (``--modes`` picks some); a run
is compared with fp32 state's on its own machine, in a row per lr and machine.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import statistics
import textwrap
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from realtext import all_windows, batches, fixed_batches, stdlib_tokens
from torch import Tensor
from torch.optim.adam import adam
from transformers import AutoModelForCausalLM

from megatrain_lightning.optim import codecs, kernel, rounding
from megatrain_lightning.optim.adamw import COMPRESSIONS
from megatrain_lightning.optim.quantized import quantized_adamw_
from megatrain_lightning.presets import tiny_config
from megatrain_lightning.store.layout import SMALL_PARAM

BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
EPS = 1e-8
VAL_BATCH = 64  # windows per validation batch of the curve
GOALS = {"int8": 0.2, "int4": 0.5, "int3": 2.0, "int2": 2.0}  # % of fp32's final validation loss


def shipped_tokens() -> tuple[Tensor, Tensor]:
    path = Path(__import__("megatrain_lightning").__file__).with_name("data") / "tiny_corpus.txt"
    tokens = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
    cut = int(tokens.numel() * 0.95)
    return tokens[:cut], tokens[cut:]


def machine(device: torch.device) -> str:
    """The CPU and the kernels a run used (and the GPU the model ran on). fp32 training rounds differently
    on another CPU or GPU (its matmuls and vectorized AdamW), so runs of two machine types differ as the
    noise floor's do: compare like with like."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    gpu = f", model on {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    return f"{cpu}, torch {torch.backends.cpu.get_cpu_capability()}, kernel {kernel.backend()}{gpu}"


def make_model(hidden: int, layers: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    heads = max(1, hidden // 64)
    config = tiny_config(
        "llama",
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
    )
    return AutoModelForCausalLM.from_config(config)


class StateAdamW:
    """CPUAdamW's arithmetic outside the engine: fused quantized steps for the large decoder-layer
    tensors (``bits``), torch's fused AdamW on fp32 moments for the rest (``fused=False``: its foreach
    implementation, the same arithmetic in another order). As under megatrain, the optimizer runs on the
    CPU over fp32 masters: with the model on a GPU, gradients come to the host and updated weights go back
    (on the CPU the masters are the parameters themselves: no copies). ``only`` ("m" or "v"): every
    tensor steps on fp32 moments, and then that moment of the large decoder-layer tensors makes a round
    trip through the format's codec (its rounding): which moment a format's change comes from.
    ``rounding_seed`` picks another stream of stochastic rounding's random numbers (0: the optimizer's own,
    keyed by the tensor's index): two runs that differ in it alone show how far the rounding's draws
    carry a run."""

    def __init__(
        self,
        model: torch.nn.Module,
        bits: int | None,
        stochastic: tuple[str, ...] | None,
        fused: bool = True,
        only: str | None = None,
        rounding_seed: int = 0,
    ) -> None:
        # on a GPU: page-locked masters and gradient buffers, so the copies each way run at the link's rate
        self.params = [
            (n, p, p.detach().cpu().pin_memory() if p.is_cuda else p.detach())
            for n, p in model.named_parameters()
            if p.requires_grad
        ]
        self.grad_buffers = {
            n: torch.empty_like(master).pin_memory() for n, p, master in self.params if p.is_cuda
        }
        self.bits, self.stochastic, self.fused, self.only = bits, stochastic, fused, only
        self.seed_base = rounding_seed << 16  # above every tensor index
        self.state: dict[str, tuple] = {}
        self.round_trip: list[str] = []
        for name, _, master in self.params:
            if bits and ".layers." in name and master.numel() >= SMALL_PARAM:
                if only:
                    self.round_trip.append(name)
                else:
                    self.state[name] = codecs.empty_state(master.numel(), bits)
                    continue
            self.state[name] = (torch.zeros_like(master), torch.zeros_like(master))
        self.step_count = 0

    @torch.no_grad()
    def step(self, lr: float) -> None:
        taken = float(self.step_count)  # torch's adam counts this step itself: it takes the steps before
        self.step_count += 1  # the fused quantized step takes this one's number
        grads = {}
        for name, p, _ in self.params:
            grads[name] = self.grad_buffers[name].copy_(p.grad, non_blocking=True) if p.is_cuda else p.grad
        if self.grad_buffers:
            torch.cuda.synchronize()  # also the previous step's weight copies: the masters are free to write
        fp32 = [(n, p) for n, _, p in self.params if len(self.state[n]) == 2]
        for decay in (True, False):
            group = [(n, p) for n, p in fp32 if (p.dim() >= 2) == decay]
            adam(
                [p for _, p in group],
                [grads[n] for n, _ in group],
                [self.state[n][0] for n, _ in group],
                [self.state[n][1] for n, _ in group],
                [],
                [torch.tensor(taken) for _ in group],
                foreach=not self.fused,
                fused=self.fused,
                decoupled_weight_decay=True,
                amsgrad=False,
                beta1=BETAS[0],
                beta2=BETAS[1],
                lr=lr,
                weight_decay=WEIGHT_DECAY if decay else 0.0,
                eps=EPS,
                maximize=False,
            )
        for index, (name, _, master) in enumerate(self.params):
            state = self.state[name]
            if len(state) == 2:
                continue
            quantized_adamw_(
                master.view(-1),
                grads[name].view(-1),
                *state,
                bits=self.bits,
                stochastic=self.stochastic,
                seed=self.seed_base + index,
                step=self.step_count,
                lr=lr,
                beta1=BETAS[0],
                beta2=BETAS[1],
                eps=EPS,
                weight_decay=WEIGHT_DECAY,
            )
        for index, name in enumerate(self.round_trip):
            kind, which = self.only, "mv".index(self.only)
            moment = self.state[name][which]
            key = rounding.rounding_keys(self.seed_base + index, self.step_count)[which]
            sr = kind in codecs.FORMATS[self.bits].stochastic
            codes, scales = codecs.quantize(moment, kind, self.bits, key if sr else None)
            moment.copy_(codecs.dequantize(codes, scales, kind, self.bits, moment.numel()).view_as(moment))
        for _, p, master in self.params:
            if p.is_cuda:
                p.copy_(master, non_blocking=True)


def lm_loss(model: torch.nn.Module, tokens: Tensor) -> Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


@torch.no_grad()
def val_loss(model: torch.nn.Module, val: list[Tensor]) -> float:
    return sum(float(lm_loss(model, b)) for b in val) / len(val)


@torch.no_grad()
def window_losses(model: torch.nn.Module, windows: Tensor, batch: int = 256) -> Tensor:
    """Each window's mean next-token loss: the final model on the whole held-out split. Two runs' losses on
    the same windows give their difference with a paired standard error, which says how much of it the
    choice of validation text alone could make."""
    losses, device = [], next(model.parameters()).device
    for rows in windows.split(batch):
        rows = rows.to(device)
        logits = model(input_ids=rows[:, :-1]).logits
        targets = rows[:, 1:].reshape(-1)
        per_token = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets, reduction="none")
        losses.append(per_token.view(rows.size(0), -1).mean(1))
    return torch.cat(losses).cpu()


def lr_at(step: int, lr: float, warmup: int, total: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


ROUNDINGS = {"nearest": (), "sr-v": ("v",), "sr-m": ("m",), "sr-mv": ("m", "v")}
ONE_MOMENT = {"m-only": "m", "v-only": "v"}  # the other moment fp32 (StateAdamW's ``only``)
# fp32 state through torch's foreach AdamW instead of its fused one: the same arithmetic in another order,
# so how far it ends from "none" is how far any perturbation of a few ulps carries: the benchmark's noise
NOISE_FLOOR = "none:foreach"


class Mode(NamedTuple):
    """A ``--modes`` entry: what ``StateAdamW`` is given."""

    compression: str
    stochastic: tuple[str, ...] | None  # the moments rounded stochastically (None: the format's)
    only: str | None  # the one moment compressed (None: both)
    rounding_seed: int  # StateAdamW's


def parse_mode(mode: str) -> Mode:
    """``"int4"`` (the format's rounding) or ``"int4:nearest"`` / ``":sr-v"`` / ``":sr-m"`` / ``":sr-mv"``;
    ``"int4:m-only"`` / ``":v-only"`` (one moment compressed); any of them with ``"/r1"`` (``/rN``): the
    rounding's random numbers from stream N; or ``NOISE_FLOOR``."""
    if mode == NOISE_FLOOR:
        return Mode("none", None, None, 0)
    spec, _, stream = mode.partition("/r")
    name, _, variant = spec.partition(":")
    if (
        name not in COMPRESSIONS
        or (variant and variant not in ROUNDINGS and variant not in ONE_MOMENT)
        or (stream and (not stream.isdigit() or name == "none"))
    ):
        raise SystemExit(
            f"mode {mode!r}: a compression of {tuple(COMPRESSIONS)}, optionally "
            f":{'|'.join([*ROUNDINGS, *ONE_MOMENT])} and then (compressed state) /rN, another stream of "
            f"random numbers for stochastic rounding; or {NOISE_FLOOR}"
        )
    return Mode(name, ROUNDINGS.get(variant), ONE_MOMENT.get(variant), int(stream or 0))


def train(
    args, train_tokens: Tensor, val: list[Tensor], held_out: Tensor, mode: str, lr: float, seed: int
) -> dict:
    torch.set_float32_matmul_precision(args.matmul_precision)
    model = make_model(args.hidden, args.layers, seed).to(args.device)
    val = [b.to(args.device) for b in val]
    spec = parse_mode(mode)
    opt = StateAdamW(model, COMPRESSIONS[spec.compression], spec.stochastic, fused=mode != NOISE_FLOOR,
                     only=spec.only, rounding_seed=spec.rounding_seed)  # fmt: skip
    data = batches(train_tokens, args.batch, args.seq + 1, seed=seed)
    curve, train_losses = [], []
    start = time.perf_counter()
    for step in range(args.steps):
        model.zero_grad(set_to_none=False)
        loss = lm_loss(model, next(data).to(args.device))
        loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step(lr_at(step, lr, args.warmup, args.steps))
        train_losses.append(loss.item())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append((step + 1, val_loss(model, val)))
            elapsed = time.perf_counter() - start
            eta = elapsed / (step + 1) * (args.steps - step - 1)
            print(f"  {mode} lr {lr:g} seed {seed}: step {step + 1}/{args.steps} val loss {curve[-1][1]:.4f} "
                  f"({elapsed:.0f} s, ETA {eta:.0f} s)", flush=True)  # fmt: skip
    seconds, device = time.perf_counter() - start, torch.device(args.device)
    result = dict(mode=mode, lr=lr, seed=seed, final=curve[-1][1], curve=curve, train=train_losses,
                  seconds=seconds, machine=machine(device))  # fmt: skip
    if args.held_out:
        windows = window_losses(model, held_out)
        result.update(held_out=float(windows.double().mean()), windows=[round(float(x), 5) for x in windows])
    return result


def run_grid(args, tokens: Tensor, val: list[Tensor], held_out: Tensor, header: str) -> list[dict]:
    """Every (seed, lr, mode) run, ``--jobs`` at a time, each in a process of its own with ``--threads``
    threads. Results come in the grid's order whichever ends first, and the JSON is rewritten as each run
    ends, so an interrupted grid keeps the runs that finished."""
    grid = [(mode, lr, seed) for seed in args.seeds for lr in args.lrs for mode in args.modes]
    done: dict[int, dict] = {}

    def finished(index: int, r: dict) -> None:
        done[index] = r
        print(f"lr {r['lr']:g} seed {r['seed']} {r['mode']:>5}: final val loss {r['final']:.4f} "
              f"({r['seconds']:.0f} s)", flush=True)  # fmt: skip
        results = [done[i] for i in sorted(done)]
        Path(args.json).write_text(json.dumps(dict(header=header, args=vars(args), results=results)))

    if args.jobs == 1:
        for index, run in enumerate(grid):
            finished(index, train(args, tokens, val, held_out, *run))
    else:
        spawn = multiprocessing.get_context("spawn")  # a forked process cannot use CUDA
        threads = dict(initializer=torch.set_num_threads, initargs=(args.threads,))
        with ProcessPoolExecutor(args.jobs, spawn, **threads) as pool:
            runs = {pool.submit(train, args, tokens, val, held_out, *run): i for i, run in enumerate(grid)}
            for future in as_completed(runs):
                finished(runs[future], future.result())
    return [done[i] for i in sorted(done)]


def spread(finals: list[float], single: str) -> str:
    """(max - min) / mean of final losses, in percent; ``single`` where there is one."""
    return (
        f"{(max(finals) - min(finals)) / statistics.mean(finals) * 100:.2f}%" if len(finals) > 1 else single
    )


def mean_over_seeds(changes: list[float]) -> str:
    """`` (mean +x.xx%)`` of two seeds' changes; from three seeds on with its standard error (two say
    little of their spread)."""
    if len(changes) < 2:
        return ""
    error = f" ± {statistics.stdev(changes) / len(changes) ** 0.5:.2f}%" if len(changes) > 2 else ""
    return f" (mean {statistics.mean(changes):+.2f}%{error})"


def machine_of(run: dict) -> str:
    return run.get("machine", "machine not recorded")


def machine_tags(results: list[dict]) -> dict[str, str]:
    """A letter per machine where the runs come from several (``{}`` for one): the tables pair each run
    with fp32 state's on its own machine, in a row of its own, since fp32 rounds differently elsewhere."""
    machines = sorted({machine_of(r) for r in results})
    return {m: chr(ord("A") + i) for i, m in enumerate(machines)} if len(machines) > 1 else {}


def row_label(lr: float, machine: str, tags: dict[str, str]) -> str:
    return f"{lr:g} ({tags[machine]})" if tags else f"{lr:g}"


def report(results: list[dict], modes: list[str]) -> list[str]:
    """The change of each mode's final validation loss against fp32 state's of the same seed and machine,
    and its mean over the seeds (from three seeds on with its standard error); a row per lr and machine.
    Verdicts apply the issue's bounds to the worst seed: "ok" within them, "lower" beyond them only below
    fp32 state's loss, "NOT met" above. Beside fp32's seed spread, the spread of every fp32-state run
    (every seed, fused and ``NOISE_FLOOR``): the noise a quantized run's change is read against."""
    columns = "| lr | fp32 final val loss (seeds) | fp32 seed spread | fp32-state runs' spread (n) | "
    lines = [columns + " | ".join(
        f"{m} change (per seed)" for m in modes if m != "none") + " |"]  # fmt: skip
    lines.append("| --- " * (4 + len(modes) - 1) + "|")
    tags = machine_tags(results)
    for lr, machine in sorted({(r["lr"], machine_of(r)) for r in results}):
        row = [r for r in results if (r["lr"], machine_of(r)) == (lr, machine)]
        by = {(r["mode"], r["seed"]): r["final"] for r in row}
        seeds = sorted({s for _, s in by})
        ref = [by[("none", s)] for s in seeds if ("none", s) in by]
        fp32 = [final for (m, _), final in by.items() if m in ("none", NOISE_FLOOR)]
        cells = [
            row_label(lr, machine, tags),
            " / ".join(f"{x:.4f}" for x in ref),
            spread(ref, "one seed"),
            f"{spread(fp32, '-')} ({len(fp32)})",
        ]
        for m in modes:
            if m == "none":
                continue
            changes = [
                (by[(m, s)] / by[("none", s)] - 1) * 100 for s in seeds if (m, s) in by and ("none", s) in by
            ]
            goal = GOALS.get(parse_mode(m).compression)
            if not changes:
                cells.append("not run")
                continue
            verdict = "" if goal is None else " (ok)" if max(map(abs, changes)) <= goal else " (lower)"
            if goal is not None and max(changes) > goal:
                verdict = " (NOT met)"
            cells.append(" / ".join(f"{c:+.2f}%" for c in changes) + mean_over_seeds(changes) + verdict)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def held_out_report(results: list[dict], modes: list[str], curve_windows: int) -> list[str]:
    """The change of each mode's loss on the whole held-out split against fp32 state's (same lr and seed),
    with the paired standard error of the mean of per-window differences: how much of a change the choice
    of validation windows alone makes (over all of them, and over as many windows as the curve's
    ``--val-batches`` hold). Windows are consecutive text, so neighbours correlate and the figure is a
    lower bound. A change well beyond it is the trained weights', not the validation sample's."""
    runs = {(r["mode"], r["lr"], machine_of(r), r["seed"]): r for r in results if "windows" in r}
    others = [m for m in modes if m != "none"]
    columns = ["lr", "seed", "fp32 held-out loss", *(f"{m} change (s.e.; at the curve's)" for m in others)]
    lines = ["| " + " | ".join(columns) + " |", "| --- " * len(columns) + "|"]
    tags = machine_tags(results)
    for trajectory in sorted(key[1:] for key in runs if key[0] == "none"):
        lr, machine, seed = trajectory
        ref = runs[("none", *trajectory)]
        base = torch.tensor(ref["windows"], dtype=torch.float64)
        cells = [row_label(lr, machine, tags), str(seed), f"{ref['held_out']:.4f}"]
        for m in others:
            if (m, *trajectory) not in runs:
                cells.append("not run")
                continue
            windows = torch.tensor(runs[(m, *trajectory)]["windows"], dtype=torch.float64)
            diff = (windows - base) / base.mean() * 100
            cells.append(f"{float(diff.mean()):+.2f}% ({float(diff.std() / diff.numel() ** 0.5):.2f}%; "
                         f"{float(diff.std() / curve_windows ** 0.5):.2f}%)")  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines if len(lines) > 2 else []


def merge_results(files: list[list[dict]]) -> list[dict]:
    """The runs of several result files, a later file's run replacing an earlier one of the same mode, lr,
    seed and machine (a rerun, e.g. after a change of a format), so that the table and the plot read the
    same runs. Another machine's run is kept beside it: another trajectory, paired with its own fp32."""
    merged = {(r["mode"], r["lr"], r["seed"], machine_of(r)): r for results in files for r in results}
    replaced = sum(map(len, files)) - len(merged)
    if replaced:
        print(f"{replaced} runs replaced by a later file's run of the same mode, lr, seed and machine")
    return list(merged.values())


def curve_label(run: dict, runs: list[dict]) -> str | None:
    """Each curve's seed and final loss for one or two seeds; from three on one entry per mode, its mean
    final loss over the seeds (a legend of every run would cover the panel)."""
    finals = [r["final"] for r in runs if r["mode"] == run["mode"]]
    if len(finals) <= 2:
        return f"{run['mode']} s{run['seed']} ({run['final']:.3f})"
    first = min(r["seed"] for r in runs if r["mode"] == run["mode"])
    mean = statistics.mean(finals)
    return f"{run['mode']} ({len(finals)} seeds, mean {mean:.3f})" if run["seed"] == first else None


def plot(results: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrs = sorted({r["lr"] for r in results})
    # one colour per mode in every panel (the default cycle's 10, else tab20's), one line style per seed
    modes = list(dict.fromkeys(r["mode"] for r in results))
    colors = {
        mode: f"C{i}" if len(modes) <= 10 else plt.get_cmap("tab20")(i % 20) for i, mode in enumerate(modes)
    }
    first_seed = min(r["seed"] for r in results)
    fig, axes = plt.subplots(1, len(lrs), figsize=(5 * len(lrs), 4), squeeze=False)
    for ax, lr in zip(axes[0], lrs, strict=True):
        runs = [r for r in results if r["lr"] == lr]
        for r in runs:
            steps, losses = zip(*r["curve"], strict=True)
            ax.plot(steps, losses, label=curve_label(r, runs), linewidth=1, color=colors[r["mode"]],
                    linestyle="-" if r["seed"] == first_seed else "--")  # fmt: skip
        ax.set(xlabel="step", ylabel="validation loss", title=f"lr {lr:g}")
        ax.legend(fontsize=7)
    fig.suptitle(textwrap.fill(title, width=70 * len(lrs)), fontsize=9)  # about 70 characters fit a panel
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", choices=["stdlib", "shipped"], default="stdlib")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=None, help="default: 5%% of --steps")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument(
        "--modes",
        nargs="+",
        help="compressions, optionally with a rounding: int4:nearest, int4:sr-v, int4:sr-m, int4:sr-mv, or "
        "one moment compressed: int4:m-only, int4:v-only; then optionally /rN: stochastic rounding's random "
        "numbers from stream N (int4/r1); none:foreach (the noise floor). Default: every compression "
        f"({' '.join(COMPRESSIONS)}); with --report, every mode in the files",
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument(
        "--clip", type=float, default=None, help="clip the gradients' norm (Lightning's gradient_clip_val)"
    )
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--val-batches", type=int, default=16)
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (the optimizer's, and the model's on cpu)"
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs at once, a process each (at most the cores / --threads)"
    )
    parser.add_argument(
        "--device", default="cpu", help="where the model computes, e.g. cuda (the optimizer stays on the CPU)"
    )
    parser.add_argument(
        "--matmul-precision",
        choices=["highest", "high", "medium"],
        default="highest",
        help="torch.set_float32_matmul_precision for the model's matmuls (high: TF32 on a GPU's tensor "
        "cores; the same for every mode, the optimizer's arithmetic unchanged)",
    )
    parser.add_argument(
        "--held-out",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also evaluate the final model on the whole held-out split, window by window",
    )
    parser.add_argument("--json", default=str(Path(__file__).with_name("convergence.json")))
    parser.add_argument("--out", help="the plot; by default the (first) JSON's name with .png")
    parser.add_argument(
        "--report", nargs="+", metavar="JSON", help="only merge these results: table and plot"
    )
    args = parser.parse_args()
    args.out = args.out or str(Path(args.report[0] if args.report else args.json).with_suffix(".png"))
    if args.report:
        runs = [json.loads(Path(f).read_text()) for f in args.report]
        results = merge_results([run["results"] for run in runs])
        if args.modes:  # e.g. leave out a file's runs of a format changed since
            results = [r for r in results if r["mode"] in args.modes]
            if not results:
                raise SystemExit(f"--modes {' '.join(args.modes)}: no such runs in {' '.join(args.report)}")
        order = [NOISE_FLOOR, *COMPRESSIONS]  # then any roundings, as they come
        modes = sorted(dict.fromkeys(r["mode"] for r in results), key=lambda m: (order + [m]).index(m))
        print(runs[0]["header"])
        curve_windows = runs[0]["args"]["val_batches"] * VAL_BATCH
        print("\n".join(report(results, modes) + held_out_report(results, modes, curve_windows)))
        machines = [f"{tag}: {m}" for m, tag in machine_tags(results).items()] or [machine_of(results[0])]
        print("runs made on: " + "; ".join(machines))
        plot(results, args.out, runs[0]["header"])
        return
    args.modes = args.modes or list(COMPRESSIONS)
    args.warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)
    torch.set_num_threads(args.threads)
    train_tokens, val_tokens = stdlib_tokens() if args.corpus == "stdlib" else shipped_tokens()
    val = fixed_batches(val_tokens, args.val_batches, VAL_BATCH, args.seq + 1)
    held_out = all_windows(val_tokens, args.seq + 1)
    n_params = sum(p.numel() for p in make_model(args.hidden, args.layers, 0).parameters())
    header = (
        f"{args.corpus} corpus ({train_tokens.numel() / 1e6:.2f}M train / "
        f"{val_tokens.numel() / 1e6:.2f}M validation bytes), Llama {n_params / 1e6:.1f}M params "
        f"(hidden {args.hidden}, {args.layers} layers), "
        f"{args.steps} steps of {args.batch} x {args.seq} tokens, warmup {args.warmup} + cosine, "
        f"{f'gradients clipped to norm {args.clip:g}, ' if args.clip else ''}"
        f"{f'matmul precision {args.matmul_precision}, ' if args.matmul_precision != 'highest' else ''}"
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(header, flush=True)
    print(f"AdamW kernel: {kernel.prepare()}", flush=True)  # built here once, not by every worker at once
    results = run_grid(args, train_tokens, val, held_out, header)
    curve_windows = args.val_batches * VAL_BATCH
    print("\n".join(report(results, args.modes) + held_out_report(results, args.modes, curve_windows)))
    plot(results, args.out, header)
    print(f"wrote {args.json} and {args.out}")


if __name__ == "__main__":
    main()
