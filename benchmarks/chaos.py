"""Chaos, full versions (issue 17): the same weights under random delays, kills and disk faults.

    python benchmarks/chaos.py                 # timing, long, kill and fault parts, in that order
    python benchmarks/chaos.py timing kill     # some parts only

- ``timing``: for host and disk tiers, fp32 and int4 optimizer state, without and with clipping plus
  accumulation, ``--steps`` steps of the tiny Llama under ``--seeds`` delay seeds (0-``--delay-ms`` ms at
  a ``--p`` share of every hand-off) give weights bitwise equal to the run without delays, and for fp32
  state to plain Lightning's;
- ``long``: one ``--long-steps`` run with delays (disk tier, int4, clipping and accumulation), bitwise;
- ``kill``: ``--kills`` runs SIGKILLed at a random hit of a random point (forward/backward fetch, gradient
  add, update, disk write-back, checkpoint file, checkpoint replace), each resumed from
  ``ckpt_path="last"``: finished bitwise equal to the uninterrupted run, every checkpoint that looks
  complete verifies and holds the uninterrupted run's weights of its step, nothing left behind;
- ``fault``: ``--faults`` runs with EIO or ENOSPC at a random store or checkpoint read or write: each
  stops with an error naming the file and what to do, the checkpoints hold no stale weights, and the
  run resumes from the last one to the same weights.

Each trial prints one JSON line; a summary per part is printed at the end (paste it into RESULTS.md).
The short versions are in ``tests/test_chaos.py``.
"""

from __future__ import annotations

import argparse
import errno
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from chaos_runs import KILL_POINTS, fault_trial, kill_trial, run_child  # noqa: E402
from conftest import tiny_model, user_fit  # noqa: E402

from megatrain_lightning import MegaTrainStrategy  # noqa: E402
from megatrain_lightning.engine import chaos  # noqa: E402

TWO_SLOTS, SMALL_CACHE = 3.2e-4, 1.4e-3
CLIP_ACCUMULATE = {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2}
FAULT_POINTS = ("disk.write", "disk.read", "ckpt.write", "ckpt.read", "tensor.read", "ckpt.replace")
FAULT_HINTS = {errno.ENOSPC: "free space", errno.EIO: "check the disk"}


def strategy(tier: str, compression: str, folder: Path) -> MegaTrainStrategy:
    disk = {"offload_dir": folder, "max_cpu_gb": SMALL_CACHE} if tier == "disk" else {}
    return MegaTrainStrategy(max_vram_gb=TWO_SLOTS, optimizer_compression=compression, **disk)


def weights_equal(a, b) -> bool:
    want, got = a.state_dict(), b.state_dict()
    return want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def timing_case(
    model, folder: Path, tier: str, compression: str, options: dict, steps: int, seeds, spec
) -> dict:
    calm = user_fit(model, strategy(tier, compression, folder / "calm"), steps=steps, **options)
    row = {"tier": tier, "state": compression, "options": options, "steps": steps, "seeds": len(seeds)}
    if compression == "none":
        plain = user_fit(model, "auto", steps=steps, **options)
        row["equals_plain"] = weights_equal(plain, calm) and plain.losses == calm.losses
    row["failures"] = []
    hits = 0
    for seed in seeds:
        with chaos.enabled(f"seed={seed},{spec}") as injected:
            run = user_fit(model, strategy(tier, compression, folder / f"s{seed}"), steps=steps, **options)
        hits += sum(injected.hits.values())
        if not (weights_equal(calm, run) and calm.losses == run.losses):
            row["failures"].append(seed)
    row["hits"] = hits
    return row


def part_timing(args, folder: Path) -> list[dict]:
    model, rows = tiny_model("llama"), []
    for tier in ("host", "disk"):
        for compression in ("none", "int4"):
            for options in ({}, CLIP_ACCUMULATE):
                start = time.perf_counter()
                spec = f"delay_ms={args.delay_ms},p={args.p}"
                case = folder / f"{tier}-{compression}-{len(options)}"
                row = timing_case(
                    model, case, tier, compression, options, args.steps, range(args.seeds), spec
                )
                row["seconds"] = round(time.perf_counter() - start, 1)
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def part_long(args, folder: Path) -> list[dict]:
    start = time.perf_counter()
    spec = f"delay_ms={args.delay_ms},p={args.p}"
    row = timing_case(
        tiny_model("llama"), folder, "disk", "int4", CLIP_ACCUMULATE, args.long_steps, [7], spec
    )
    row["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(row), flush=True)
    return [row]


def part_kill(args, folder: Path, rng: random.Random) -> list[dict]:
    reference = folder / "reference"
    hits = run_child(reference, "seed=0")["hits"]
    rows = []
    for trial in range(args.kills):
        point = KILL_POINTS[trial % len(KILL_POINTS)]
        total = sum(n for name, n in hits.items() if name.startswith(point))
        try:
            row = kill_trial(folder / f"kill{trial}", reference, point, rng.randint(1, total), seed=trial)
        except RuntimeError as err:  # the harness's own failure: counted, not fatal
            row = {"point": point, "harness_error": str(err), "killed": False}
        row["ok"] = bool(
            row["killed"]
            and not row["stale_checkpoints"]
            and row["resumed_from_step"] == row["expected_resume_step"]
            and row["same_weights"]
            and not row["leftovers"]
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def part_fault(args, folder: Path, rng: random.Random) -> list[dict]:
    reference = folder / "reference"
    if not (reference / "final.pt").exists():
        run_child(reference, "seed=0")
    hits = run_child(folder / "count", "seed=0")["hits"]
    resume_hits = run_child(folder / "count", "seed=0", resume=True, epochs=4)["hits"]  # reads on resume
    rows = []
    for trial in range(args.faults):
        point = FAULT_POINTS[trial % len(FAULT_POINTS)]
        code = "EIO" if point.endswith(".read") else rng.choice(("EIO", "ENOSPC"))  # a full disk fails writes
        total = (resume_hits if point.endswith(".read") and point != "disk.read" else hits).get(point, 1)
        try:
            row = fault_trial(folder / f"fault{trial}", reference, point, rng.randint(1, total), code)
        except RuntimeError as err:  # the harness's own failure: counted, not fatal
            row = {"point": point, "harness_error": str(err), "stale_checkpoints": [], "error": None}
        error = row["error"] or ""
        # A run with fewer hits of the point than drawn (disk reads vary with the cache's timing) finishes
        # without a fault: it must then still end with the right weights.
        row["reached"] = row["error"] is not None or "harness_error" in row
        row["ok"] = (not row["reached"] and row["same_weights"]) or bool(
            "harness_error" not in row
            and str(folder / f"fault{trial}") in error
            and FAULT_HINTS[getattr(errno, code)] in error
            and not row["stale_checkpoints"]
            and row["resume_error"] is None
            and row["same_weights"]
            and not row["leftovers"]
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("parts", nargs="*", default=["timing", "long", "kill", "fault"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--long-steps", type=int, default=1000)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--p", type=float, default=0.1, help="share of hand-offs that sleep")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--faults", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0, help="draws the kill and fault points")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    summary = {}
    with tempfile.TemporaryDirectory(prefix="megatrain-chaos-") as tmp:
        for part in args.parts:
            start = time.perf_counter()
            folder = Path(tmp) / part
            if part == "timing":
                rows = part_timing(args, folder)
                bad = sum(len(r["failures"]) + (r.get("equals_plain") is False) for r in rows)
                runs = sum(r["seeds"] for r in rows)
            elif part == "long":
                rows = part_long(args, folder)
                bad, runs = len(rows[0]["failures"]), 1
            elif part == "kill":
                rows = part_kill(args, folder, rng)
                bad, runs = sum(not r["ok"] for r in rows), len(rows)
            elif part == "fault":
                rows = part_fault(args, folder, rng)
                bad, runs = sum(not r["ok"] for r in rows), sum(r["reached"] for r in rows)
            else:
                parser.error(f"unknown part {part!r}")
            summary[part] = {"trials": runs, "failures": bad, "seconds": round(time.perf_counter() - start)}
    print("| part | trials (faults: injected) | failures | seconds |\n| --- | ---: | ---: | ---: |")
    for part, row in summary.items():
        print(f"| {part} | {row['trials']} | {row['failures']} | {row['seconds']} |")


if __name__ == "__main__":
    main()
