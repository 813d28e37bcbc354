"""Compressed-state AdamW throughput: megatrain's fused int8/int4/int3/int2 step against its memory floor,
``torch.optim.AdamW(fused=True)`` (fp32 state) and the CPU low-bit optimizers that exist today.

One ``--numel``-parameter block (100M by default), ``--threads`` torch threads (2). Each round
times, back to back, the memory bandwidth of two in-place streams over ``--numel`` fp32 (``x.mul_(c)``:
8 bytes per element; ``x.add_(y)``: 12), our steps in every format and torch's fused AdamW, so that every
ratio compares numbers measured under the same background load; the report gives medians over rounds of
the per-round figures. The *floor* of a step is its bytes moved per parameter (param r/w 8 + grad 4 +
state r/w: int8 16.09, int4 14.19, int3 13.75, int2 13.38; fp32 AdamW: 28) divided by the faster
stream's bandwidth in that round (``x.mul_`` alone can be slower than a step that reads more arrays: on
a Xeon 34-35 GB/s, while torch's fused AdamW moved 41-42); the goal is each quantized step within 1.5x of
its floor.

Then, each once, if importable (never installed by this project; skipped with a message):
torchao ``AdamW8bit``/``AdamW4bit`` (torch.compile'd, the first step compiles), bitsandbytes
``AdamW8bit`` on CPU and DeepSpeed's ``DeepSpeedCPUAdam`` (fp32 state, JIT-built with
``DS_ACCELERATOR=cpu``; the first build takes minutes), timed on ``--others-numel`` parameters
(bitsandbytes on ``--bnb-numel``: it runs at a few M params/s), and our int8 step on the same size.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from megatrain_lightning.optim import codecs
from megatrain_lightning.optim import kernel as K
from megatrain_lightning.optim import quantized as Q
from megatrain_lightning.optim.adamw import COMPRESSIONS

MODES = {name: bits for name, bits in COMPRESSIONS.items() if bits}  # int8, int4, int3, int2
HP = dict(lr=1e-6, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
GOAL = 1.5  # step time / floor time
STREAM_BYTES = {"x.mul_(c)": 8, "x.add_(y)": 12}  # bytes moved per element by each bandwidth probe


def bytes_per_param(bits: int | None) -> float:
    """Bytes one step moves per parameter: fp32 AdamW (``None``) or the quantized step."""
    if bits is None:
        return 28.0  # param r/w 8, grad 4, m r/w 8, v r/w 8
    n = 1 << 20
    return 12.0 + 2 * codecs.state_bytes(n, bits) / n  # param r/w 8 + grad 4 + state r/w


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Ours:
    def __init__(self, numel: int, bits: int, use_kernel: bool | None = None) -> None:
        g = torch.Generator().manual_seed(0)
        self.param = torch.randn(numel, generator=g)
        self.grad = torch.randn(numel, generator=g)
        self.state = codecs.empty_state(numel, bits)
        self.bits, self.use_kernel, self.count = bits, use_kernel, 0

    def step(self) -> None:
        self.count += 1
        Q.quantized_adamw_(
            self.param,
            self.grad,
            *self.state,
            bits=self.bits,
            step=self.count,
            use_kernel=self.use_kernel,
            **HP,
        )


class TorchOptimizer:
    def __init__(
        self, numel: int, factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
    ) -> None:
        g = torch.Generator().manual_seed(0)
        self.param = torch.nn.Parameter(torch.randn(numel, generator=g))
        self.param.grad = torch.randn(numel, generator=g)
        self.optimizer = factory([self.param])

    def step(self) -> None:
        self.optimizer.step()


def bench_main(numel: int, rounds: int) -> dict[str, list[float]]:
    """Rounds of [each stream, each format, fused fp32], interleaved; seconds per call."""
    x, y = torch.randn(numel), torch.randn(numel)
    probes = (lambda: x.mul_(1.0000001), lambda: x.add_(y, alpha=1e-9))
    streams = dict(zip(STREAM_BYTES, probes, strict=True))  # named once, in STREAM_BYTES
    runs = {
        **{name: Ours(numel, bits) for name, bits in MODES.items()},
        "torch fused fp32": TorchOptimizer(
            numel, lambda ps: torch.optim.AdamW(ps, fused=True, **_torch_hp())
        ),
    }
    for run in runs.values():  # warm-up: page in the state, build/load the kernel
        run.step()
    for stream in streams.values():
        stream()
    times: dict[str, list[float]] = {k: [] for k in (*streams, *runs)}
    for _ in range(rounds):
        for name, stream in streams.items():
            times[name].append(timed(stream))
        for name, run in runs.items():
            times[name].append(timed(run.step))
    return times


def _torch_hp() -> dict:
    return dict(lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=HP["weight_decay"])


def report_main(times: dict[str, list[float]], numel: int) -> dict[str, float]:
    rates = {name: [size * numel / t for t in times[name]] for name, size in STREAM_BYTES.items()}
    for name, rate in rates.items():
        print(f"{name}: median {statistics.median(rate) / 1e9:.2f} GB/s")
    bw = [max(round_rates) for round_rates in zip(*rates.values(), strict=True)]
    print(f"\nmemory bandwidth (the faster stream per round): median {statistics.median(bw) / 1e9:.2f} GB/s, "
          f"range {min(bw) / 1e9:.2f}..{max(bw) / 1e9:.2f}")  # fmt: skip
    print(f"\n{'step':<18} {'B/param':>8} {'median s':>9} {'Gparam/s':>9} {'floor Gparam/s':>15} "
          f"{'x floor':>8} {'vs fused':>9}")  # fmt: skip
    fused = times["torch fused fp32"]
    summary = {"bandwidth_GBps": statistics.median(bw) / 1e9}
    for name, bits in (*MODES.items(), ("torch fused fp32", None)):
        t = times[name]
        per_byte = bytes_per_param(bits)
        floor = [b / per_byte for b in bw]  # params/s at the memory floor, per round
        x_floor = statistics.median(ti * f / numel for ti, f in zip(t, floor, strict=True))
        vs_fused = statistics.median(tf / ti for ti, tf in zip(t, fused, strict=True))
        rate = numel / statistics.median(t)
        print(f"{name:<18} {per_byte:8.2f} {statistics.median(t):9.4f} {rate / 1e9:9.3f} "
              f"{statistics.median(floor) / 1e9:15.3f} {x_floor:8.2f} {vs_fused:9.2f}")  # fmt: skip
        summary[f"{name} Gparam/s"] = rate / 1e9
        summary[f"{name} x floor"] = x_floor
        summary[f"{name} vs fused"] = vs_fused
    for name in MODES:
        verdict = "met" if summary[f"{name} x floor"] <= GOAL else "NOT met"
        print(f"{name}: {summary[f'{name} x floor']:.2f}x its memory floor (goal <= {GOAL}: {verdict}), "
              f"{summary[f'{name} vs fused']:.2f}x the speed of torch fused fp32 AdamW")  # fmt: skip
    print("\nper-round seconds:")
    for name, t in times.items():
        print(f"  {name:<18} " + " ".join(f"{s:.4f}" for s in t))
    return summary


ISA_FLAGS = {"avx2": ["-march=native", "-mno-avx512f", "-fopenmp"]}  # --isa: another path on this CPU


def _kernel_from(source: Path, isa: str | None) -> K._Kernel:
    """The kernel built from ``source`` (and the headers beside it), for this CPU or with ``ISA_FLAGS``."""
    mine = K._SOURCE
    K._SOURCE, K._kernel, K._kernel_error = source, None, None
    try:
        if isa is None:
            kernel = K.load_kernel()
            assert kernel is not None, K._kernel_error
            return kernel
        compiler = K._compiler()
        assert compiler is not None, "no C++ compiler"
        return K._Kernel(K._build(compiler, [ISA_FLAGS[isa]]))
    finally:
        K._SOURCE = mine


def bench_sources(
    numel: int,
    rounds: int,
    other: Path | None,
    other_rounding: tuple[str, ...] | None,
    isa: str | None = None,
) -> None:
    """This checkout's kernel and roundings against another kernel, built from ``other`` (an earlier
    ``quantized_adamw.cpp``, with the headers beside it: e.g. in ``git worktree add /tmp/before REV``),
    and/or other roundings (``other_rounding``: the moments every format rounds stochastically, for an
    older kernel that rejects today's or to price a rounding): steps of each format alternated on the same
    data; medians per element, their ratio, and whether the two left the same parameters and state bit
    for bit (never, where the roundings differ). ``isa``: both sides built for another code path this CPU
    can run (``ISA_FLAGS``: e.g. AVX2 on an AVX-512 CPU)."""
    kernels = {"this": _kernel_from(K._SOURCE, isa)}
    kernels["other"] = kernels["this"] if other is None else _kernel_from(Path(other), isa)
    print(f"kernels: {kernels['this'].isa}")
    print(f"\n{'step':<6} {'this ns/param':>14} {'other ns/param':>15} {'this / other':>13} {'bitwise':>8}")
    g = torch.Generator().manual_seed(0)
    param, grad = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    roundings = {"this": None, "other": other_rounding}
    for name, bits in MODES.items():
        runs = {k: (param.clone(), codecs.empty_state(numel, bits)) for k in kernels}
        times: dict[str, list[float]] = {k: [] for k in kernels}
        for step in range(1, rounds + 2):
            for k, kernel in kernels.items():
                K._kernel = kernel
                p, state = runs[k]
                start = time.perf_counter()
                Q.quantized_adamw_(
                    p, grad, *state, bits=bits, step=step, use_kernel=True, stochastic=roundings[k], **HP
                )
                if step > 1:  # the first pages the state in
                    times[k].append(time.perf_counter() - start)
        this, that = (statistics.median(times[k]) * 1e9 / numel for k in kernels)
        (p1, s1), (p2, s2) = runs.values()
        same = torch.equal(p1, p2) and all(torch.equal(a, b) for a, b in zip(s1, s2, strict=True))
        print(f"{name:<6} {this:14.3f} {that:15.3f} {this / that:13.3f} {str(same):>8}")
    K._kernel = kernels["this"]


# -- third-party optimizers --


def _torchao(bits: int) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    from torchao.optim import AdamW4bit, AdamW8bit

    cls = AdamW8bit if bits == 8 else AdamW4bit
    return lambda ps: cls(ps, **_torch_hp())


def _bnb(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(ps, min_8bit_size=0, **_torch_hp())


def _deepspeed(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(ps, adamw_mode=True, **_torch_hp())


def bench_others(numel: int, bnb_numel: int, steps: int) -> list[tuple[str, int, float, float]]:
    """(name, numel, first-step seconds, median seconds of ``steps`` later steps) for each importable one."""
    candidates = [
        ("torchao AdamW8bit", numel, lambda n: TorchOptimizer(n, _torchao(8))),
        ("torchao AdamW4bit", numel, lambda n: TorchOptimizer(n, _torchao(4))),
        ("bitsandbytes AdamW8bit (CPU)", bnb_numel, lambda n: TorchOptimizer(n, _bnb)),
        ("DeepSpeedCPUAdam (fp32 state)", numel, lambda n: TorchOptimizer(n, _deepspeed)),
    ]
    results = []
    for name, n, make in candidates:
        try:
            run = make(n)
            first = timed(run.step)
        except Exception as err:  # absent or broken: say so and go on
            reason = str(err).splitlines()[0][:150] if str(err) else ""
            print(f"  {name}: skipped ({type(err).__name__}: {reason})")
            continue
        later = [timed(run.step) for _ in range(steps)]
        results.append((name, n, first, statistics.median(later)))
        print(f"  {name}: {n / statistics.median(later) / 1e6:.1f} M params/s on {n / 1e6:.0f}M "
              f"(first step {first:.1f} s)", flush=True)  # fmt: skip
        del run
        gc.collect()
    return results


def report_others(results: list[tuple[str, int, float, float]], steps: int) -> None:
    if not results:
        return
    ours: dict[int, dict[int, float]] = {}
    for n in sorted({r[1] for r in results}):
        ours[n] = {}
        for bits in (8, 4):
            run = Ours(n, bits)
            run.step()
            ours[n][bits] = statistics.median(timed(run.step) for _ in range(max(steps, 3)))
            del run
            gc.collect()
    print(f"\n{'optimizer':<32} {'params':>7} {'Mparam/s':>9} {'ours int8 is':>13} {'ours int4 is':>13}")
    for name, n, _first, t in results:
        print(
            f"{name:<32} {n / 1e6:6.0f}M {n / t / 1e6:9.1f} {t / ours[n][8]:12.1f}x {t / ours[n][4]:12.1f}x"
        )
    for n, by_bits in ours.items():
        print(f"{'ours int8 / int4 (same size)':<32} {n / 1e6:6.0f}M "
              f"{n / by_bits[8] / 1e6:9.1f} / {n / by_bits[4] / 1e6:.1f}")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=100_000_000, help="parameters in the block")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument(
        "--others-numel", type=int, default=100_000_000, help="parameters for torchao/DeepSpeed"
    )
    parser.add_argument(
        "--bnb-numel", type=int, default=20_000_000, help="parameters for bitsandbytes (slow)"
    )
    parser.add_argument(
        "--others-steps", type=int, default=2, help="timed steps after the first, per optimizer"
    )
    parser.add_argument("--no-others", action="store_true", help="skip the third-party optimizers")
    parser.add_argument("--fallback", action="store_true", help="also time the pure-torch fallback once")
    parser.add_argument(
        "--vs-source",
        type=Path,
        help="only: this kernel against one built from this .cpp and the headers beside it (A/B, bitwise)",
    )
    parser.add_argument(
        "--vs-rounding",
        nargs="*",
        choices=("m", "v"),
        help="only: the moments the other side rounds stochastically (every format; none if empty), "
        "against this kernel's shipped roundings",
    )
    parser.add_argument(
        "--isa",
        choices=tuple(ISA_FLAGS),
        help="with --vs-source/--vs-rounding: both kernels built for this code path, not this CPU's best",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.vs_source is not None or args.vs_rounding is not None:
        vs_rounding = tuple(args.vs_rounding) if args.vs_rounding is not None else None
        bench_sources(args.numel, args.rounds, args.vs_source, vs_rounding, args.isa)
        return
    start = time.perf_counter()
    build = timed(K.load_kernel)
    print(f"{args.numel / 1e6:.0f}M parameters, {torch.get_num_threads()} threads, backend {K.backend()} "
          f"(loaded/built in {build:.1f} s), torch {torch.__version__}; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    times = bench_main(args.numel, args.rounds)
    report_main(times, args.numel)
    gc.collect()
    if args.fallback:
        for bits in MODES.values():
            run = Ours(args.numel, bits, use_kernel=False)
            t = timed(run.step)
            print(f"torch fallback int{bits}: {args.numel / t / 1e9:.3f} Gparam/s")
            del run
            gc.collect()
    if not args.no_others:
        print("\nthird-party CPU optimizers:", flush=True)
        results = bench_others(args.others_numel, args.bnb_numel, args.others_steps)
        report_others(results, args.others_steps)
    print(f"\ntotal {time.perf_counter() - start:.0f} s; load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
