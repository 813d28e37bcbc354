"""What the disk tier's cache bookkeeping costs the compute thread: CPU seconds per step in choosing what
to evict (``best_window``) and in the read-ahead walk (``_load_ahead``), beside the process's CPU time
per step, on a model cut into many chunks (as a 7B layer is into 50 chunks of 16 MB).

The bookkeeping runs with the store's lock held, in whichever thread pins or finishes an I/O; at the
7B scale it once took most of each step (py-spy: 64% of samples) while the I/O threads sat idle
(``benchmarks/RESULTS.md``, "7B, sixth session"). ``_load_ahead``'s time includes the ``best_window`` calls
its read-ahead makes. Run it before and after a change to the cache:

    python benchmarks/cache_cost.py                 # 13.7M Llama, cache 0.14 of the store, int4, bf16-mixed
    python benchmarks/cache_cost.py --share 0.77
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import lightning as L

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from conftest import tiny_model, user_fit  # noqa: E402

from megatrain_lightning import MegaTrainStrategy  # noqa: E402
from megatrain_lightning.engine.blocks import discover_blocks  # noqa: E402
from megatrain_lightning.store import disk, sizing  # noqa: E402

CHUNKS_PER_BLOCK = 50


class Timed:
    """Wraps a function: calls and seconds spent in it."""

    def __init__(self, fn):
        self.fn, self.calls, self.seconds = fn, 0, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.calls += 1
            self.seconds += time.perf_counter() - start


class StepClock(L.Callback):
    def __init__(self, *timed: Timed) -> None:
        self.timed, self.marks = timed, {}

    def on_train_batch_end(self, trainer, *args) -> None:
        stats = trainer.strategy.stats
        self.marks[trainer.global_step] = (
            time.process_time(),
            time.perf_counter(),
            [(t.calls, t.seconds) for t in self.timed],
            stats.disk_read_bytes + stats.disk_write_bytes,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--share", type=float, default=0.14, help="cache / (weights + optimizer state)")
    parser.add_argument("--steps", type=int, default=5, help="steps 3.. are measured")
    args = parser.parse_args()

    best_window = Timed(disk.best_window)
    load_ahead = Timed(disk.DiskStore._load_ahead)
    disk.best_window = best_window
    disk.DiskStore._load_ahead = lambda self: load_ahead(self)
    model = tiny_model("llama", num_hidden_layers=16, hidden_size=256, intermediate_size=688)
    blocks = discover_blocks(model)
    largest = max(b.numel for b in blocks)
    store_bytes = sizing.region_bytes(blocks) + sizing.state_bytes(blocks, "int4")
    clock = StepClock(best_window, load_ahead)
    with tempfile.TemporaryDirectory() as directory:
        strategy = MegaTrainStrategy(
            offload_dir=directory,
            max_cpu_gb=args.share * store_bytes / 1e9,
            max_vram_gb=2 * 4 * largest / 1e9,
            io_chunk_mb=4 * largest / CHUNKS_PER_BLOCK / 2**20,
            optimizer_compression="int4",
        )
        user_fit(model, strategy, steps=args.steps, callbacks=[clock], precision="bf16-mixed")
    (cpu0, wall0, timed0, io0), (cpu1, wall1, timed1, io1) = clock.marks[2], clock.marks[args.steps]
    n = args.steps - 2
    cpu = (cpu1 - cpu0) / n
    print(
        f"per step (steps 3..{args.steps}): process CPU {cpu:.2f} s, wall {(wall1 - wall0) / n:.2f} s, "
        f"store traffic {(io1 - io0) / n / 1e6:.0f} MB"
    )
    for name, (c0, s0), (c1, s1) in zip(("best_window", "_load_ahead"), timed0, timed1, strict=True):
        seconds = (s1 - s0) / n
        share = seconds / cpu
        print(f"  {name}: {(c1 - c0) / n:.0f} calls, {seconds:.2f} s ({share:.0%} of the process CPU)")


if __name__ == "__main__":
    main()
