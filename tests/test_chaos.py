"""Chaos (issue 17): the same weights under random delays at every hand-off, kills and disk faults.

Short versions of ``benchmarks/chaos.py`` (a few seeds, a few kills, a few faults); the injector is
:mod:`megatrain_lightning.engine.chaos`."""

from __future__ import annotations

import errno
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from chaos_runs import fault_trial, kill_trial, run_child
from conftest import Run, assert_same_training, tiny_model, user_fit

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.engine import chaos, runtime
from megatrain_lightning.engine.grads import HostGrads
from megatrain_lightning.serialization import publish

STEPS = 4
TWO_SLOTS = 3.2e-4  # max_vram_gb: two slots of the tiny Llama, so blocks are evicted and prefetched
SMALL_CACHE = 1.4e-3  # max_cpu_gb: weights, gradients and state go to disk and come back every step

# (tier, optimizer state, Trainer options, delay seeds): each of host/disk, fp32/int4, clipping, accumulation
CASES = [
    ("host", "none", {}, (1, 2)),
    ("disk", "none", {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2}, (3,)),
    ("host", "int4", {"gradient_clip_val": 0.05}, (4,)),
    ("disk", "int4", {"accumulate_grad_batches": 2}, (5,)),
    ("host-async", "none", {"accumulate_grad_batches": 2}, (6,)),
]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model("llama")


@pytest.fixture(autouse=True)
def _offload_thread(request, monkeypatch) -> None:
    """``host-async``: gradients are added in the offload worker thread, as on CUDA."""
    if "host-async" in request.node.name:
        monkeypatch.setattr(runtime, "HostGrads", functools.partial(HostGrads, asynchronous=True))


def strategy(tier: str, compression: str, offload_dir) -> MegaTrainStrategy:
    disk = {"offload_dir": offload_dir, "max_cpu_gb": SMALL_CACHE} if tier == "disk" else {}
    return MegaTrainStrategy(max_vram_gb=TWO_SLOTS, optimizer_compression=compression, **disk)


def assert_bitwise(expected: Run, actual: Run) -> None:
    assert actual.losses == expected.losses
    want, got = expected.state_dict(), actual.state_dict()
    assert want.keys() == got.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{name} differs"


@pytest.mark.parametrize(("tier", "compression", "options", "seeds"), CASES, ids=lambda c: str(c))
def test_random_delays_give_the_same_weights(model, tmp_path, tier, compression, options, seeds):
    reference = user_fit(model, strategy(tier, compression, tmp_path / "calm"), steps=STEPS, **options)
    assert len(reference.losses) == STEPS * options.get("accumulate_grad_batches", 1)
    if compression == "none":
        assert_same_training(user_fit(model, "auto", steps=STEPS, **options), reference)
    for seed in seeds:
        with chaos.enabled(f"seed={seed},delay_ms=20,p=0.3") as injected:
            run = user_fit(
                model, strategy(tier, compression, tmp_path / f"seed{seed}"), steps=STEPS, **options
            )
        assert sum(injected.hits.values()) > 50  # the points were hit (and slept at random)
        assert_bitwise(reference, run)


# -- kill and recover; disk faults (runs in child processes: tests/chaos_runs.py) --


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict[str, int]]:
    """The uninterrupted run (three epochs of two steps, a checkpoint after each) and its points' hits."""
    root = tmp_path_factory.mktemp("reference")
    return root, run_child(root, "seed=0")["hits"]


def kth(hits: dict[str, int], point: str, share: float) -> int:
    """The hit of ``point`` (a name prefix) ``share`` of the way through the uninterrupted run."""
    return max(1, int(share * sum(n for name, n in hits.items() if name.startswith(point))))


@pytest.mark.parametrize(
    ("point", "share", "seed"),
    [("grads.add", 0.3, 1), ("disk.write", 0.6, 2), ("ckpt.write", 0.7, 3)],
)
def test_a_killed_run_resumes_to_the_same_weights(reference, tmp_path, point, share, seed):
    root, hits = reference
    trial = kill_trial(tmp_path, root, point, kth(hits, point, share), seed)
    assert trial["killed"], trial
    assert trial["stale_store"], "the kill left no store behind: nothing was reclaimed"
    assert trial["stale_checkpoints"] == [], "a checkpoint that looks complete holds other weights"
    assert trial["resumed_from_step"] == trial["expected_resume_step"]
    assert trial["same_weights"]
    assert trial["leftovers"] == [], "a killed run's partial checkpoint or store outlived the next run"


def test_a_kill_while_last_ckpt_is_replaced_resumes_from_it(reference, tmp_path):
    """Regression (found by the kill loop, ``kill=ckpt.replace:1``): killed between the two renames that
    replaced ``last.ckpt``, the previous one was left at ``last.ckpt.old-<pid>``, so ``ckpt_path="last"``
    found nothing and the resumed run silently restarted from step 0. It is now swapped in one step."""
    root, _ = reference
    trial = kill_trial(tmp_path, root, "ckpt.replace", 1, seed=0)
    assert trial["killed"] and trial["resumed_from_step"] == 2 and trial["same_weights"], trial
    assert trial["leftovers"] == []


def test_recover_undoes_an_interrupted_two_rename_replace(tmp_path):
    """Where there is no atomic swap: the previous checkpoint moved aside by a dead process comes back,
    a dead process's partial copy goes, a live process's stays."""
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid, live_pid = int(dead.stdout), os.getppid()
    target = tmp_path / "last.ckpt"
    for name in (f"last.ckpt.old-{dead_pid}", f"last.ckpt.tmp-{dead_pid}", f"last.ckpt.tmp-{live_pid}"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(name)
    publish.recover(str(target))
    assert (target / "manifest.json").read_text() == f"last.ckpt.old-{dead_pid}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", f"last.ckpt.tmp-{live_pid}"]


FAULTS = [  # (point, share of its hits in the reference run: disk I/O varies with timing, errno, file, hint)
    ("disk.write", 0.3, "ENOSPC", "megatrain_store/", "free space"),
    ("disk.read", 0.2, "EIO", "megatrain_store/", "check the disk"),
    ("ckpt.write", 0.5, "ENOSPC", ".ckpt.tmp-", "free space"),
    ("tensor.read", 0.05, "EIO", "last.ckpt/model/", "check the disk"),
]


@pytest.mark.parametrize(("point", "share", "code", "file", "hint"), FAULTS)
def test_a_disk_fault_stops_the_run_clearly_and_loses_nothing(
    reference, tmp_path, point, share, code, file, hint
):
    root, hits = reference
    trial = fault_trial(tmp_path, root, point, kth(hits, point, share), code)
    error = trial["error"]
    assert error is not None and os.strerror(getattr(errno, code)) in error, trial
    assert str(tmp_path) in error and file in error and hint in error, error
    assert trial["stale_checkpoints"] == [], "a checkpoint holds weights trained on a failed read or write"
    assert trial["resume_error"] is None and trial["same_weights"], "the previous checkpoint did not resume"
    assert trial["leftovers"] == []
