"""The peer: DeepSpeed ZeRO-3 with parameters and optimizer state offloaded to NVMe, on this CPU box.

Trains the same model and batches as ``bench_disk.py``'s overlap part (``bench_engine.build_model``
and ``make_batches``: same seeds, so the same initial weights and tokens) and prints the time of
each step (forward + ``engine.backward`` + ``engine.step``). Driven directly, not through
Lightning (whose ``DeepSpeedStrategy`` refuses a CPU accelerator), with what DeepSpeed needs here:
``DS_ACCELERATOR=cpu`` set before it is imported, a one-process gloo group, ``libaio-dev`` (apt) for
its async I/O op, ``torch._dynamo`` imported before the model is built, and the model built
normally (``zero.Init`` would leave its weights uninitialized) before ``deepspeed.initialize``.

Run: ``python benchmarks/ds_peer.py --seq 1024 --nvme-dir /work/ds_nvme``. DeepSpeed is an
optional benchmark dependency (``pip install deepspeed``, which must not replace torch); without
it this prints a message and exits 0. ``--json PATH`` writes the results for ``bench_disk.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

SKIP_EXIT = 0  # DeepSpeed missing is not an error: the peer is optional


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ds_config(nvme_dir: str, lr: float, pipeline: bool) -> dict[str, Any]:
    """ZeRO-3, parameters and optimizer state on NVMe (``nvme_dir``), torch AdamW's defaults otherwise."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": 1e8,
            "stage3_prefetch_bucket_size": 1e7,
            "reduce_bucket_size": 1e7,
            "sub_group_size": 1e8,
            "offload_param": {
                "device": "nvme",
                "nvme_path": nvme_dir,
                "pin_memory": False,
                "buffer_count": 5,
                "buffer_size": 1e8,
                "max_in_cpu": 1e9,
            },
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": nvme_dir,
                "pin_memory": False,
                "buffer_count": 4,
                "pipeline_read": pipeline,
                "pipeline_write": pipeline,
            },
        },
        "aio": {
            "block_size": 1 << 20,
            "queue_depth": 8,
            "intra_op_parallelism": 1,
            "single_submit": False,
            "overlap_events": True,
        },
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the model, train ``warmup + steps`` steps under ZeRO-3 NVMe offload; return the timings."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }.items():
        os.environ.setdefault(key, value)
    import torch
    import torch._dynamo  # noqa: F401  (imported lazily inside DeepSpeed's hooks it fails)
    import torch.distributed as dist

    if args.threads:
        torch.set_num_threads(args.threads)
    import deepspeed

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_engine import bench_config, build_model, make_batches

    dist.init_process_group("gloo", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo")
    nvme_dir = os.path.abspath(args.nvme_dir)
    shutil.rmtree(nvme_dir, ignore_errors=True)
    os.makedirs(nvme_dir)
    config = bench_config(args.quick, args.size)
    model = build_model(config)
    batches = make_batches(config.vocab_size, args.warmup + args.steps, args.batch, args.seq)
    start = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(nvme_dir, args.lr, args.pipeline)
    )
    init_s = time.perf_counter() - start
    step_s, cpu_s, losses = [], [], []
    for batch in batches:
        start, cpu = time.perf_counter(), time.process_time()
        loss = engine(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss
        engine.backward(loss)
        engine.step()
        step_s.append(time.perf_counter() - start)
        cpu_s.append(time.process_time() - cpu)
        losses.append(loss.detach().item())
        print(f"step {len(step_s) - 1}: loss {losses[-1]:.6f}, {step_s[-1]:.3f} s", flush=True)
    dist.destroy_process_group()
    shutil.rmtree(nvme_dir, ignore_errors=True)
    timed = step_s[args.warmup :]
    return {
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "optimizer": type(engine.optimizer.optimizer).__name__
        if hasattr(engine.optimizer, "optimizer")
        else type(engine.optimizer).__name__,
        "init_s": init_s,
        "step_s": timed,
        "cpu_s": cpu_s[args.warmup :],
        "median_s": statistics.median(timed),
        "losses": losses,
        "threads": torch.get_num_threads(),
        "config": ds_config(nvme_dir, args.lr, args.pipeline),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="170m", help="Llama shape for llama_config (ignored with --quick)")
    parser.add_argument("--quick", action="store_true", help="bench_engine's small model: a smoke run")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before the timed ones")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--nvme-dir", default="ds_nvme", help="DeepSpeed's swap folder (emptied, then removed)"
    )
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="pipelined optimizer swap-in/out (DeepSpeed 0.19.8 fails an assertion with it on the 170M)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1, --warmup >= 0")
    if importlib.util.find_spec("deepspeed") is None:
        print("ds_peer: deepspeed is not installed (`pip install deepspeed`, keeping torch); peer skipped.")
        sys.exit(SKIP_EXIT)
    result = run(args)
    print(
        f"DeepSpeed {result['deepspeed']} ZeRO-3 NVMe offload ({result['optimizer']}): median step "
        f"{result['median_s']:.3f} s over {len(result['step_s'])} timed steps; "
        f"initialize {result['init_s']:.1f} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
