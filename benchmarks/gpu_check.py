"""GPU checks of the megatrain strategy in one script (about 3-5 minutes on one GPU).

1. ``parity``: the tiny Llama and the tiny GPT-2 (tied embeddings), 10 optimizer steps on ``cuda``,
   plain Lightning vs megatrain (its default budget; and two slots without activation
   checkpointing), from the same initial weights and batches, ``"32-true"``: the largest relative
   loss difference and the largest absolute parameter difference. GPU kernels are not bitwise
   deterministic, so small nonzero differences are expected. Then ``"bf16-mixed"``: megatrain's
   losses must fall on a repeated batch and its store must stay fp32.
2. ``stream``: the pager's achieved host->device rate (``stats.h2d_bytes`` over the wall time of
   forward-only passes of a model with a two-block budget, so the passes are transfer-bound) vs a
   raw ``copy_(non_blocking=True)`` of the same blocks from pinned memory into a device buffer.
3. ``bench``: ``bench_engine``'s four-case step-time comparison on ``cuda`` with a bigger batch.

Without CUDA it says so and exits 0 (``--cpu`` runs the same checks on the CPU instead, to test
this script). Exits 1 when a check fails. Run as ``python benchmarks/gpu_check.py``.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from bench_engine import (
    BenchModule,
    bench_config,
    block_bytes,
    build_model,
    close,
    compare,
    fit,
    make_batches,
    trainer_kwargs,
)
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.utils.data import DataLoader
from transformers import PretrainedConfig, PreTrainedModel

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.engine.blocks import discover_blocks
from megatrain_lightning.presets import llama_config, tiny_config

LOSS_RTOL = 1e-4  # parity: largest relative loss difference accepted
PARAM_ATOL = 1e-3  # parity: largest absolute parameter difference accepted (an Adam step moves a weight ~lr)
LR = 1e-3


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def _sync(accelerator: str) -> None:
    if accelerator == "cuda":
        torch.cuda.synchronize()


def _two_slots(model: PreTrainedModel, itemsize: int = 4, **kwargs: Any) -> MegaTrainStrategy:
    """Megatrain with a budget of two of ``model``'s largest blocks (a hair over, against rounding)."""
    return MegaTrainStrategy(max_vram_gb=block_bytes(model, itemsize)[1] * 2 * 1.001 / 1e9, **kwargs)


def _train(
    model: PreTrainedModel,
    batches: Sequence[dict[str, Tensor]],
    strategy: Any,
    accelerator: str,
    precision: str,
) -> tuple[list[float], dict[str, Tensor], L.Trainer]:
    """Train a copy of ``model``; return the losses, the final weights (on the CPU) and the trainer."""
    trainer, timer = fit(copy.deepcopy(model), batches, strategy, accelerator, precision, lr=LR)
    state = trainer.strategy.lightning_module_state_dict()  # megatrain's: views of its store
    weights = {k: v.detach().cpu().clone() for k, v in state.items() if v.is_floating_point()}
    close(trainer)
    return timer.losses, weights, trainer


def parity(accelerator: str) -> list[Check]:
    """Plain vs megatrain, fp32, for the tiny Llama and GPT-2; then megatrain in bf16-mixed."""
    checks = []
    for arch in ("llama", "gpt2"):
        config = tiny_config(arch)
        model = build_model(config)
        batches = make_batches(config.vocab_size, 10, batch=4, seq=64)
        ref_losses, ref_state, _ = _train(model, batches, "auto", accelerator, "32-true")
        variants = {
            "megatrain (default budget)": "megatrain",
            "megatrain (2 slots, no act. ckpt)": _two_slots(model, activation_checkpointing=False),
        }
        for label, strategy in variants.items():
            losses, state, _ = _train(model, batches, strategy, accelerator, "32-true")
            loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
            shared = sorted(set(state) & set(ref_state))
            param_abs = max((state[k].float() - ref_state[k].float()).abs().max().item() for k in shared)
            unmatched = sorted(set(ref_state) ^ set(state))
            ok = loss_rel <= LOSS_RTOL and param_abs <= PARAM_ATOL and not unmatched
            detail = f"max rel loss diff {loss_rel:.3g}, max abs param diff {param_abs:.3g}"
            if unmatched:
                detail += f"; in one state dict only: {unmatched[:4]}"
            checks.append(Check(f"parity {arch}, 32-true: {label} vs plain", ok, detail))
            print(f"  {checks[-1].name}: {detail}", flush=True)

    config = tiny_config("llama")
    model = build_model(config)
    batches = (
        make_batches(config.vocab_size, 1, batch=4, seq=64) * 10
    )  # one batch, repeated: the loss must fall
    plain_losses, _, _ = _train(model, batches, "auto", accelerator, "bf16-mixed")
    losses, state, trainer = _train(model, batches, "megatrain", accelerator, "bf16-mixed")
    engine = trainer.strategy.engine
    store_dtypes = {
        engine.store.read(block.index, kind).dtype
        for kind in ("param", "exp_avg", "exp_avg_sq")
        for block in engine.blocks
    }
    store_dtypes |= {v.dtype for v in state.values()}  # the state dict's weights are the store's
    ok = losses[-1] < losses[0] - 0.1 and store_dtypes == {torch.float32}
    detail = (
        f"losses {losses[0]:.4f} -> {losses[-1]:.4f} (plain bf16-mixed {plain_losses[0]:.4f} -> "
        f"{plain_losses[-1]:.4f}); store dtypes {sorted(str(d) for d in store_dtypes)}"
    )
    checks.append(Check("bf16-mixed: megatrain's losses fall and its store stays fp32", ok, detail))
    print(f"  {checks[-1].name}: {detail}", flush=True)
    return checks


def raw_copy_gbps(numels: Sequence[int], accelerator: str, repeats: int = 5) -> float:
    """GB/s of ``copy_(non_blocking=True)`` from pinned host memory into a device buffer, block by block."""
    src = torch.empty(max(numels), dtype=torch.float32, pin_memory=accelerator == "cuda")
    dst = torch.empty(max(numels), dtype=torch.float32, device=accelerator)
    dst.copy_(src, non_blocking=True)
    _sync(accelerator)
    start = time.perf_counter()
    for _ in range(repeats):
        for n in numels:
            dst[:n].copy_(src[:n], non_blocking=True)
    _sync(accelerator)
    return repeats * sum(numels) * 4 / (time.perf_counter() - start) / 1e9


class PassTimer(Callback):
    """Device-synchronized wall time and the engine's ``h2d_bytes`` at each predict batch's start and end."""

    def __init__(self, accelerator: str) -> None:
        self.accelerator = accelerator
        self.marks: list[tuple[float, int]] = []

    def _mark(self, trainer: L.Trainer) -> None:
        _sync(self.accelerator)
        self.marks.append((time.perf_counter(), trainer.strategy.stats.h2d_bytes))

    def on_predict_batch_start(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self._mark(trainer)

    def on_predict_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self._mark(trainer)


@dataclass
class PagerPass:
    """Forward-only passes that prefetch along the trace: their mean time and bytes moved per pass."""

    seconds: float
    nbytes: int
    num_slots: int
    stats: dict[str, float]

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9


def pager_pass(
    config: PretrainedConfig, accelerator: str, precision: str, passes: int, seq: int
) -> PagerPass:
    """Run ``passes`` predict batches of ``config``'s model under megatrain with a two-block budget."""
    model = build_model(config)
    strategy = _two_slots(model, itemsize=4 if precision == "32-true" else 2)
    timer = PassTimer(accelerator)
    trainer = L.Trainer(strategy=strategy, callbacks=[timer], **trainer_kwargs(accelerator, precision))
    batches = make_batches(config.vocab_size, passes, batch=1, seq=seq)
    trainer.predict(BenchModule(model), DataLoader(batches, batch_size=None), return_predictions=False)
    # Pass 0 records the trace and fetches on demand; the later passes prefetch along it.
    spans = list(zip(timer.marks[2::2], timer.marks[3::2], strict=True))
    seconds = sum(end[0] - start[0] for start, end in spans) / len(spans)
    nbytes = sum(end[1] - start[1] for start, end in spans) // len(spans)
    result = PagerPass(seconds, nbytes, strategy.engine.pager.num_slots, strategy.stats.as_dict())
    close(trainer)
    return result


def stream(accelerator: str, passes: int = 8, seq: int = 32) -> list[Check]:
    """The pager's host->device rate on transfer-bound forward passes vs a raw pinned copy of its blocks,
    in fp32; and the time of a bf16 pass against an fp32 one, both with two slots (about 0.5 if bf16
    weights cross the link, about 1.0 if fp32 ones do and are converted on the device)."""
    config = llama_config("1b", num_hidden_layers=8)  # TinyLlama-shaped blocks, fewer of them
    numels = [b.numel for b in discover_blocks(build_model(config))]
    fp32 = pager_pass(config, accelerator, "32-true", passes, seq)
    bf16 = pager_pass(config, accelerator, "bf16-mixed", passes, seq)
    raw = raw_copy_gbps(numels, accelerator)
    detail = (
        f"{len(numels)} blocks, {sum(numels) * 4 / 1e9:.2f} GB (largest {max(numels) * 4 / 1e9:.3f}), "
        f"{fp32.num_slots} slots; pager {fp32.gbps:.1f} GB/s ({fp32.nbytes / 1e9:.2f} GB per pass in "
        f"{fp32.seconds * 1e3:.1f} ms), raw pinned copy {raw:.1f} GB/s: ratio {fp32.gbps / raw:.3f}; "
        f"fetch_wait_s {fp32.stats['fetch_wait_s']:.3f}, h2d_s {fp32.stats['h2d_s']:.3f}"
    )
    bf16_detail = (
        f"bf16-mixed pass {bf16.seconds * 1e3:.1f} ms vs fp32 {fp32.seconds * 1e3:.1f} ms: ratio "
        f"{bf16.seconds / fp32.seconds:.3f}; h2d_bytes per pass {bf16.nbytes / 1e9:.2f} GB vs "
        f"{fp32.nbytes / 1e9:.2f} GB"
    )
    print(f"  stream: {detail}\n  stream: {bf16_detail}", flush=True)
    return [
        Check("stream: pager h2d rate vs raw pinned copy (informational)", True, detail),
        Check("stream: bf16-mixed vs fp32 pass time (informational)", True, bf16_detail),
    ]


def bench(accelerator: str, steps: int = 4, batch: int = 8, seq: int = 512) -> list[Check]:
    """``bench_engine``'s comparison with a bigger batch; informational (its goals are for the CPU run)."""
    results = compare(bench_config(False), "abcd", steps, 2, batch, seq, accelerator=accelerator)
    base = results[0].median_s
    detail = ", ".join(f"{r.case.key}/a {r.median_s / base:.3f}" for r in results[1:])
    return [Check("bench: step-time ratios (informational)", True, detail)]


PARTS: dict[str, Callable[[str], list[Check]]] = {"parity": parity, "stream": stream, "bench": bench}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"a comma-separated subset of {list(PARTS)}")
    parser.add_argument("--cpu", action="store_true", help="run the checks on the CPU (to test this script)")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}")
    if not args.cpu and not torch.cuda.is_available():
        print("CUDA not available: nothing to check here; run this script on a machine with a GPU.")
        return 0
    accelerator = "cpu" if args.cpu else "cuda"
    device = "CPU" if args.cpu else torch.cuda.get_device_name()
    print(f"device: {device}, torch {torch.__version__}", flush=True)
    start = time.perf_counter()
    checks: list[Check] = []
    for part in parts:
        print(f"\n== {part} ==", flush=True)
        part_start = time.perf_counter()
        checks += PARTS[part](accelerator)
        print(f"  ({time.perf_counter() - part_start:.0f} s)", flush=True)
    print(f"\n== summary ({time.perf_counter() - start:.0f} s) ==")
    for check in checks:
        print(f"{'PASS' if check.ok else 'FAIL'}  {check.name}: {check.detail}")
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
