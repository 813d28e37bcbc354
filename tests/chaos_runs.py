"""Runs for the chaos tests and ``benchmarks/chaos.py``: a tiny Llama on the disk tier, a checkpoint at the
end of every epoch (each epoch is two steps: resume is exact at epoch boundaries), run in a child process
that may be SIGKILLed at a chosen point and resumed from ``ckpt_path="last"``.

Children come from a forkserver that imported torch, Lightning and transformers once, so each run starts
in well under a second and no child inherits a parent's threads."""

from __future__ import annotations

import atexit
import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
from pathlib import Path
from typing import Any

import torch
from conftest import UserLM, quiet_trainer, tiny_model, token_batches
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.engine import chaos
from megatrain_lightning.serialization.checkpoint_dir import CheckpointDir
from megatrain_lightning.serialization.publish import is_checkpoint_dir
from megatrain_lightning.serialization.safetensors_io import read_tensor

EPOCHS = 3
STEPS_PER_EPOCH = 2
TWO_SLOTS = 3.2e-4  # max_vram_gb of two slots of the tiny Llama
SMALL_CACHE = 1.4e-3  # max_cpu_gb: blocks and their state go to disk and back every step
# Where a run is killed: forward and backward fetches, gradient adds, updates, disk write-back,
# checkpoint files and the rename that replaces last.ckpt.
KILL_POINTS = ("pager.acquire", "grads.add", "update", "disk.write", "ckpt.write", "ckpt.replace")


class _StartStep(Callback):
    def __init__(self) -> None:
        self.step: int | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step


def train(root: str, spec: str | None = None, resume: bool = False, epochs: int = EPOCHS) -> dict[str, Any]:
    """Train (or resume from ``root/ckpts/last.ckpt``) to ``epochs`` epochs under chaos ``spec``; save the
    final weights to ``root/final.pt``; return the step it started from and the points' hit counts."""
    root_path = Path(root)
    start = _StartStep()
    checkpoints = ModelCheckpoint(
        dirpath=root_path / "ckpts",
        filename="{epoch}",
        save_top_k=-1,
        save_last=True,
        every_n_epochs=1,
        save_on_train_epoch_end=True,
        enable_version_counter=False,
    )
    strategy = MegaTrainStrategy(
        offload_dir=root_path / "offload", max_cpu_gb=SMALL_CACHE, max_vram_gb=TWO_SLOTS
    )
    trainer = quiet_trainer(strategy, -1, [start, checkpoints], max_epochs=epochs, enable_checkpointing=True)
    module = UserLM(tiny_model("llama"))
    batches = token_batches(STEPS_PER_EPOCH)
    with chaos.enabled(spec or "") as injected:
        torch.manual_seed(1)
        trainer.fit(
            module,
            train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None),
            ckpt_path="last" if resume else None,
        )
        torch.save(module.state_dict(), root_path / "final.pt")
    return {"start_step": start.step, "hits": injected.hits}


def _child(root: str, spec: str | None, resume: bool, epochs: int) -> None:
    try:
        result = train(root, spec, resume, epochs)
    except Exception as err:  # the parent checks what the user would see
        result = {"error": f"{type(err).__name__}: {err}"}
    (Path(root) / "result.json").write_text(json.dumps(result))
    atexit._run_exitfuncs()  # as at a script's end (a multiprocessing child skips them): the store goes


_context: Any = None


def run_child(root: str | Path, spec: str | None = None, resume: bool = False, epochs: int = EPOCHS) -> dict:
    """``train`` in a child process; its result, or ``{"killed": True}`` if it died by SIGKILL."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["chaos_runs"])
        # The forkserver finds this folder through the environment (Python 3.11 ignores its sys.path).
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(__file__), saved]))
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
    Path(root).mkdir(parents=True, exist_ok=True)  # not created for offload_dir: a failed run keeps it
    result = Path(root) / "result.json"
    result.unlink(missing_ok=True)
    child = _context.Process(target=_child, args=(str(root), spec, resume, epochs))
    child.start()
    child.join()
    if child.exitcode == -signal.SIGKILL:
        return {"killed": True}
    if child.exitcode != 0:
        raise RuntimeError(f"the run in {root} failed (exit code {child.exitcode}); see its output")
    return json.loads(result.read_text())


def complete_checkpoints(root: str | Path) -> list[str]:
    """The checkpoint directories under ``root/ckpts`` that look complete; each must verify."""
    folder = Path(root) / "ckpts"
    found = sorted(str(p) for p in folder.glob("*.ckpt") if is_checkpoint_dir(p)) if folder.exists() else []
    for path in found:
        CheckpointDir.verify(path)  # raises if a checkpoint that looks complete is not
    return found


def leftovers(root: str | Path) -> list[str]:
    """What killed runs left that a finished run should have reclaimed."""
    folder = Path(root)
    partial = [str(p) for p in (folder / "ckpts").glob("*.ckpt.*-*")] if (folder / "ckpts").exists() else []
    store = folder / "offload" / "megatrain_store"
    return partial + ([str(store)] if store.exists() else [])


def same_weights(a: str | Path, b: str | Path) -> bool:
    want, got = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def checkpoint_weights(path: str | Path) -> dict[str, torch.Tensor]:
    return {name: read_tensor(entry) for name, entry in CheckpointDir.verify(path).weights().entries.items()}


def expected_resume_step(root: str | Path) -> int | None:
    """The step ``ckpt_path="last"`` resumes from (``None``: the run was already complete)."""
    last = Path(root) / "ckpts" / "last.ckpt"
    step = CheckpointDir.verify(last).lightning_state()["global_step"] if is_checkpoint_dir(last) else 0
    return None if step == EPOCHS * STEPS_PER_EPOCH else step


def stale_checkpoints(root: Path, reference: Path) -> list[str]:
    """The complete checkpoints whose weights differ from the uninterrupted run's at the same step."""
    stale = []
    for path in complete_checkpoints(root):
        step = CheckpointDir.verify(path).lightning_state()["global_step"]
        expected = checkpoint_weights(reference / "ckpts" / f"epoch={step // STEPS_PER_EPOCH - 1}.ckpt")
        if not all(torch.equal(value, expected[name]) for name, value in checkpoint_weights(path).items()):
            stale.append(Path(path).name)
    return stale


def kill_trial(root: Path, reference: Path, point: str, k: int, seed: int) -> dict[str, Any]:
    """Run with a SIGKILL at the ``k``-th hit of ``point`` (seeded delays), check the checkpoints, resume
    from the last one, and compare the final weights with ``reference``'s."""
    killed = run_child(root, f"seed={seed},delay_ms=5,p=0.2,kill={point}:{k}")
    stale_store = (root / "offload" / "megatrain_store").exists()
    stale = stale_checkpoints(root, reference)
    expected = expected_resume_step(root)
    resumed = run_child(root, resume=True)
    return {
        "point": point,
        "k": k,
        "killed": killed.get("killed", False),
        "stale_store": stale_store,
        "stale_checkpoints": stale,
        "resumed_from_step": resumed["start_step"],
        "expected_resume_step": expected,
        "same_weights": same_weights(reference / "final.pt", root / "final.pt"),
        "leftovers": leftovers(root),
    }


def fault_trial(root: Path, reference: Path, point: str, k: int, code: str) -> dict[str, Any]:
    """Fail the ``k``-th hit of ``point`` with ``code`` (``*.read`` points of checkpoints: while resuming
    a run stopped by a failed store write); then check the checkpoints and resume without the fault."""
    if point.startswith(("ckpt.read", "tensor.read")):
        run_child(root, "fail=disk.write:60:EIO")  # stops in the last epoch: checkpoints to resume from
        failed = run_child(root, f"fail={point}:{k}:{code}", resume=True)
    else:
        failed = run_child(root, f"fail={point}:{k}:{code}")
    stale = stale_checkpoints(root, reference)
    resumed = run_child(root, resume=True)
    return {
        "point": point,
        "k": k,
        "errno": code,
        "error": failed.get("error"),
        "resume_error": resumed.get("error"),
        "stale_checkpoints": stale,
        "same_weights": same_weights(reference / "final.pt", root / "final.pt"),
        "leftovers": leftovers(root),
    }
