"""Worker threads against the compute thread's intra-op parallelism: a pure-torch ``mm`` loop.

The main thread times a loop of ``mm`` (the shape of a 170M Llama projection at 1 x 256 tokens) while
two worker threads (as the engine's prefetch and optimizer workers) are

- ``none``: absent (the reference);
- ``idle``: alive, after each ran one parallel op at the default size (then sleeping);
- ``idle-1``: the same after :func:`megatrain_lightning.engine.threads.limit_this_thread` (one thread each);
- ``busy``: copying and adding 16 MB tensors, each at the default size, with a pause after each op (a
  duty cycle like the engine's workers);
- ``busy-1``: the same, one thread each;
- ``set-1``: a worker calls ``torch.set_num_threads(1)`` (the pitfall: that also sets MKL's process-wide
  count, so the main thread's ``mm`` runs single-threaded, and ATen's default for every thread that has
  not run a parallel op yet).

The conditions run round-robin ``--repeats`` times in one process (a worker's OpenMP pool goes with
its thread, so each round starts clean), ``set-1`` last (it changes the process for good); per round
the ratio to that round's ``none`` is taken, and the median and range over the rounds are printed, with
the main thread's ``torch.get_num_threads()`` and the ops the workers did.

    python benchmarks/repro_threads.py --repeats 20
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

CONDITIONS = ("none", "idle", "idle-1", "busy", "busy-1", "set-1")


def _worker(condition: str, stop: threading.Event, ready: threading.Barrier, ops: list[int]) -> None:
    from megatrain_lightning.engine.threads import limit_this_thread

    if condition.endswith("-1") and condition != "set-1":
        limit_this_thread(1)
    if condition == "set-1":
        torch.set_num_threads(1)
    a, b = torch.randn(4 * 2**20), torch.randn(4 * 2**20)  # 16 MB each
    a.add_(b)  # one parallel op: the worker's OpenMP team exists from now on
    ready.wait()
    while not stop.is_set():
        if condition.startswith("busy"):
            a.copy_(b)
            a.add_(b)
            ops[0] += 2
        time.sleep(0.002)


def run_condition(condition: str, seconds: float, m: int, k: int, n: int) -> dict[str, float]:
    """Time the ``mm`` loop under ``condition`` in this process."""
    stop, ready, ops = threading.Event(), threading.Barrier(3), [0]
    workers = []
    if condition != "none":
        workers = [threading.Thread(target=_worker, args=(condition, stop, ready, ops)) for _ in range(2)]
        for w in workers:
            w.start()
        ready.wait()
    x, w = torch.randn(m, k), torch.randn(k, n)
    for _ in range(5):
        torch.mm(x, w)
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        torch.mm(x, w)
        times.append(time.perf_counter() - start)
    stop.set()
    for t in workers:
        t.join()
    return {"mm_s": statistics.median(times), "main_threads": torch.get_num_threads(), "worker_ops": ops[0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=0.5, help="timed mm loop per condition and round")
    parser.add_argument("--shape", default="256,1024,1024", help="m,k,n of the mm")
    args = parser.parse_args(argv)
    m, k, n = (int(v) for v in args.shape.split(","))
    rounds = [
        {c: run_condition(c, args.seconds, m, k, n) for c in CONDITIONS if c != "set-1"}
        for _ in range(args.repeats)
    ]
    rounds[-1]["set-1"] = run_condition("set-1", args.seconds, m, k, n)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(
        f"mm {m}x{k} @ {k}x{n}, {args.repeats} rounds of {args.seconds} s (set-1: last), load after: {load}"
    )
    print(f"{'condition':<9} {'mm ms':>7} {'/ none':>7} {'range':>13} {'main thr':>8} {'worker ops':>10}")
    for condition in CONDITIONS:
        ratios = [r[condition]["mm_s"] / r["none"]["mm_s"] for r in rounds if condition in r]
        mm_ms = statistics.median(r[condition]["mm_s"] for r in rounds if condition in r) * 1e3
        last = rounds[-1][condition]
        print(
            f"{condition:<9} {mm_ms:>7.3f} {statistics.median(ratios):>7.3f} "
            f"{min(ratios):>6.3f}-{max(ratios):<6.3f} {last['main_threads']:>8} {last['worker_ops']:>10}"
        )


if __name__ == "__main__":
    main()
