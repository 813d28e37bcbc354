"""CPU AdamW throughput: megatrain's ``CPUAdamW`` on a one-block store vs ``torch.optim.AdamW``.

Both update ``--numel`` fp32 parameters (100M by default) from a fixed gradient, on the same
``--threads`` torch threads. ``CPUAdamW`` is built the way the strategy builds it: over a
:class:`HostStore` of one block, with the gradient offloaded into :class:`HostGrads` and the
update threads the strategy gives the CPU over a store in RAM (none: ``step()`` runs the block's
update in its own thread, on every core); a step is timed up to ``wait_all()``. The two optimizers
step alternately (so background load hits both alike), and the median of ``--steps`` steps after
``--warmup`` is reported as parameters per second, for each implementation: ``fused``, ``foreach``
and the single-tensor loop (torch's default on CPU).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from megatrain_lightning.engine.blocks import discover_blocks
from megatrain_lightning.engine.grads import HostGrads
from megatrain_lightning.engine.runtime import EngineConfig
from megatrain_lightning.engine.threads import update_workers
from megatrain_lightning.optim.adamw import CPUAdamW
from megatrain_lightning.store.host import HostStore
from megatrain_lightning.telemetry.stats import EngineStats

IMPLS = {"fused": dict(fused=True, foreach=False), "foreach": dict(fused=False, foreach=True),
         "single": dict(fused=False, foreach=False)}  # fmt: skip
HPARAMS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
GOAL = 1.0  # CPUAdamW(fused) / torch.optim.AdamW(fused) in params/s


class FlatBlock(nn.Module):
    """A block holding one flat parameter on the meta device (its numbers live in the store)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(numel, device="meta"))


class Holder(nn.Module):
    def __init__(self, numel: int) -> None:
        super().__init__()
        self.block = FlatBlock(numel)


@dataclass
class ImplResult:
    impl: str
    torch_s: list[float]
    mega_s: list[float]
    bitwise_equal: bool


def store_adamw(init: Tensor, grad: Tensor, **kwargs: object) -> tuple[CPUAdamW, HostStore]:
    """A ``CPUAdamW`` over a one-block store holding ``init``, with ``grad`` offloaded as its gradient."""
    holder = Holder(init.numel())
    stats = EngineStats()
    blocks = discover_blocks(holder, block_classes=[FlatBlock])
    store = EngineConfig(torch.device("cpu")).make_store(blocks, stats)  # the strategy's host tier
    with store.pinned(0, "param", write=True) as flat:
        store.blocks[0].views(flat)[0].copy_(init)
    grads = HostGrads(store, torch.device("cpu"), stats)
    grads.offload(0, {0: grad}, final=True, then=lambda: None)
    param = holder.block.weight
    # As the strategy sizes it on the CPU over a store in RAM: no worker, each update in the stepping thread
    # with every core (a worker's parallel ops run on one thread there: engine/threads.py).
    threads = update_workers(torch.device("cpu"), host_tier=True, requested=None)
    optimizer = CPUAdamW(
        [param], store=store, grads=grads, locate={id(param): (0, 0)}, stats=stats, threads=threads, **kwargs
    )
    return optimizer, store


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_impl(impl: str, numel: int, steps: int, warmup: int, seed: int = 0) -> ImplResult:
    """Time ``steps`` alternating steps of both optimizers with implementation ``impl``."""
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(numel, generator=gen)
    grad = torch.randn(numel, generator=gen)
    kwargs = {**HPARAMS, **IMPLS[impl]}
    mega, store = store_adamw(init, grad, **kwargs)
    param = nn.Parameter(init)
    param.grad = grad
    reference = torch.optim.AdamW([param], **kwargs)

    def mega_step() -> None:
        mega.step()
        mega.wait_all()

    torch_s, mega_s = [], []
    for i in range(warmup + steps):
        t_torch, t_mega = _timed(reference.step), _timed(mega_step)
        if i >= warmup:
            torch_s.append(t_torch)
            mega_s.append(t_mega)
    equal = torch.equal(store.blocks[0].views(store.read(0, "param"))[0], param.detach())
    mega.close()
    return ImplResult(impl, torch_s, mega_s, equal)


def report(results: Sequence[ImplResult], numel: int) -> None:
    """Print params/s of both optimizers per implementation and the ratios."""
    torch_fused = next((r for r in results if r.impl == "fused"), None)
    print(
        f"\n{'impl':<8} {'torch s':>8} {'mega s':>8} {'torch Gparam/s':>15} {'mega Gparam/s':>14} "
        f"{'mega/torch':>11} {'mega/torch fused':>17}  bitwise"
    )
    for r in results:
        t, m = statistics.median(r.torch_s), statistics.median(r.mega_s)
        vs_fused = statistics.median(torch_fused.torch_s) / m if torch_fused else float("nan")
        print(
            f"{r.impl:<8} {t:8.4f} {m:8.4f} {numel / t / 1e9:15.3f} {numel / m / 1e9:14.3f} "
            f"{t / m:11.3f} {vs_fused:17.3f}  {r.bitwise_equal}"
        )
    if torch_fused is not None:
        ratio = statistics.median(torch_fused.torch_s) / statistics.median(torch_fused.mega_s)
        verdict = "met" if ratio >= GOAL else "NOT met"
        print(f"\nCPUAdamW(fused) / torch.optim.AdamW(fused): {ratio:.3f} (goal >= {GOAL:.1f}: {verdict})")
    print("\nstep times (s), torch | mega:")
    for r in results:
        torch_s, mega_s = (" ".join(f"{x:.3f}" for x in times) for times in (r.torch_s, r.mega_s))
        print(f"  {r.impl:<8} {torch_s} | {mega_s}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=100_000_000, help="parameters in the block")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per optimizer and implementation")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"a comma-separated subset of {IMPLS}")
    args = parser.parse_args(argv)
    impls = args.impls.split(",")
    if unknown := set(impls) - set(IMPLS):
        parser.error(f"unknown implementations {sorted(unknown)}")
    torch.set_num_threads(args.threads)
    print(
        f"{args.numel / 1e6:.1f}M fp32 parameters, {torch.get_num_threads()} threads, "
        f"{args.warmup} warm-up + {args.steps} timed steps each; load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    results = []
    for impl in impls:
        results.append(bench_impl(impl, args.numel, args.steps, args.warmup))
        gc.collect()
        print(f"  {impl} done", flush=True)
    report(results, args.numel)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
