"""The CUDA code paths that run on the CPU too: the asynchronous gradient offload (its bounded backlog),
the pager's waits, and the RNG state a checkpoint carries."""

from __future__ import annotations

import copy
import functools
import gc
import threading
import time
import weakref

import pytest
import torch
from conftest import assert_same_training, tiny_model, user_fit

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.engine import grads as grads_module
from megatrain_lightning.engine import runtime as engine_module
from megatrain_lightning.engine.blocks import discover_blocks
from megatrain_lightning.engine.grads import HostGrads
from megatrain_lightning.serialization.checkpoint_dir import CheckpointDir
from megatrain_lightning.store.host import HostStore
from megatrain_lightning.store.memory import pages
from megatrain_lightning.telemetry.stats import EngineStats

STEPS = 3
MAX_IN_FLIGHT = 2  # HostGrads' default
KINDS = ("param", "grad", "exp_avg", "exp_avg_sq")
SLOW_ADD_S = 0.02  # the injected host add: far slower than a tiny block's backward


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def plain(model):
    return user_fit(model, "auto", steps=STEPS, accumulate_grad_batches=2)


class Backlog:
    """Counts, with a slow host add patched in, the offloads issued and added and the staging buffers
    allocated; ``peak`` is the most offloads ever handed over (``offload`` returned) and not yet added."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lock = threading.Lock()
        self.issued = self.finished = self.peak = self.staging = 0
        offload, accumulate, add, host_empty = (
            HostGrads.offload,
            HostGrads._accumulate,
            HostGrads._add,
            grads_module.host_empty,
        )

        def counted_offload(grads: HostGrads, *args, **kwargs) -> None:
            offload(grads, *args, **kwargs)
            with self.lock:
                self.issued += 1
                self.peak = max(self.peak, self.issued - self.finished)

        def counted_accumulate(grads: HostGrads, *args, **kwargs) -> None:
            try:
                accumulate(grads, *args, **kwargs)
            finally:
                with self.lock:
                    self.finished += 1

        def slow_add(*args, **kwargs) -> None:
            time.sleep(SLOW_ADD_S)
            add(*args, **kwargs)

        def counted_host_empty(*args, **kwargs) -> torch.Tensor:
            self.staging += 1
            return host_empty(*args, **kwargs)

        monkeypatch.setattr(HostGrads, "offload", counted_offload)
        monkeypatch.setattr(HostGrads, "_accumulate", counted_accumulate)
        monkeypatch.setattr(HostGrads, "_add", slow_add)
        monkeypatch.setattr(grads_module, "host_empty", counted_host_empty)


def test_offload_backlog_is_bounded_and_trains_exactly(model, plain, monkeypatch):
    """With the host add far slower than backward, the compute thread waits: never more than
    ``max_in_flight`` offloads and staging buffers. And the training is still plain Lightning's: the
    offloads of an accumulating micro-batch, still running when the next one's ``optimizer.step`` begins,
    do not start their blocks' updates with part of the gradient."""
    monkeypatch.setattr(engine_module, "HostGrads", functools.partial(HostGrads, asynchronous=True))
    backlog = Backlog(monkeypatch)
    run = user_fit(model, MegaTrainStrategy(), steps=STEPS, accumulate_grad_batches=2)
    assert backlog.issued >= 2 * STEPS * len(discover_blocks(model))
    assert backlog.peak == MAX_IN_FLIGHT, f"{backlog.peak} offloads in flight at once"
    assert 1 <= backlog.staging <= MAX_IN_FLIGHT, f"{backlog.staging} staging buffers"
    assert run.trainer.strategy.stats.offload_wait_s > 0
    # host_bytes counts what is held (whole pages: pinned for exactly those on CUDA), staging included.
    store = run.trainer.strategy.engine.store
    held = sum(pages(store.layout(b, k)[1] * 4) for b in range(len(store.blocks)) for k in KINDS)
    staging = backlog.staging * pages(4 * max(b.numel for b in store.blocks))
    assert store.nbytes() == held and run.trainer.strategy.stats.host_bytes == held + staging
    monkeypatch.undo()
    assert_same_training(plain, run)


def test_offload_keeps_no_reference_to_the_gradients(model, monkeypatch):
    """A gradient handed to ``offload`` is free once the call returns (on CUDA its memory is kept for the
    copy by ``record_stream``, not by a Python reference), even while its host add has not started."""
    gate, add = threading.Event(), HostGrads._add
    monkeypatch.setattr(HostGrads, "_add", lambda *args: gate.wait(10) and add(*args))
    blocks = discover_blocks(copy.deepcopy(model))
    grads = HostGrads(HostStore(blocks), torch.device("cpu"), EngineStats(), asynchronous=True)
    alive, ready, expected = [], [], {}

    def offload(block: int) -> None:
        grad = torch.full(blocks[block].params[0].shape, float(block + 1))
        expected[block] = grad.clone()
        alive.append(weakref.ref(grad))
        grads.offload(block, {0: grad}, final=True, then=functools.partial(ready.append, block))

    for block in range(MAX_IN_FLIGHT):  # as many as fit without waiting; the worker is held at the gate
        offload(block)
    gc.collect()
    assert ready == [] and [ref() for ref in alive] == [None] * MAX_IN_FLIGHT
    gate.set()
    for block in range(MAX_IN_FLIGHT, len(blocks)):
        offload(block)
    grads.flush()
    assert ready == list(range(len(blocks)))
    for block, grad in expected.items():
        assert torch.equal(blocks[block].views(grads.store.read(block, "grad"))[0], grad)
    grads.close()


def test_pageable_staging_is_copied_by_the_worker(model, plain, monkeypatch):
    """Where page-locking failed, a device-to-host copy into the pageable staging buffer would block the
    compute thread until the device caught up: the worker copies instead, holding the gradients until
    then; the training is unchanged. (On the CPU every staging buffer is pageable: forced here.)"""
    monkeypatch.setattr(HostGrads, "_worker_copies", lambda self, staging: True)
    blocks = discover_blocks(copy.deepcopy(model))
    grads = HostGrads(HostStore(blocks), torch.device("cpu"), EngineStats(), asynchronous=True)
    taken, take = [], HostGrads._take_staging
    monkeypatch.setattr(HostGrads, "_take_staging", lambda self: taken.append(take(self)) or taken[-1])
    gate = threading.Event()
    grads._worker.submit(gate.wait, 10)  # the worker is busy: what happens before it runs is this thread's
    grad = torch.full(blocks[0].params[0].shape, 3.0)
    alive = weakref.ref(grad)
    grads.offload(0, {0: grad}, final=True, then=lambda: None)
    del grad
    gc.collect()
    assert alive() is not None, "the gradient must stay alive until the worker has copied it"
    assert not taken[0].any(), "the compute thread copied into pageable staging"
    gate.set()
    grads.flush()
    assert alive() is None
    assert torch.equal(
        blocks[0].views(grads.store.read(0, "grad"))[0], torch.full(blocks[0].params[0].shape, 3.0)
    )
    grads.close()
    monkeypatch.setattr(engine_module, "HostGrads", functools.partial(HostGrads, asynchronous=True))
    assert_same_training(plain, user_fit(model, MegaTrainStrategy(), steps=STEPS, accumulate_grad_batches=2))


def test_checkpoint_saves_and_restores_the_cuda_rng_state(model, tmp_path, monkeypatch):
    """On CUDA the root device's generator (dropout) is saved and restored with the CPU's; a checkpoint
    without it (saved on the CPU, or by an older version) still loads. The device is faked on the CPU."""
    run = user_fit(model, MegaTrainStrategy(), steps=1)
    strategy = run.trainer.strategy
    device_state = torch.arange(16, dtype=torch.uint8)
    restored: list[tuple[torch.Tensor, torch.device]] = []
    monkeypatch.setattr(MegaTrainStrategy, "root_device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: device_state.clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((state, device)))
    cpu_state = torch.get_rng_state()
    run.trainer.save_checkpoint(tmp_path / "ckpt")
    saved = CheckpointDir.verify(tmp_path / "ckpt").lightning_state()
    assert torch.equal(saved["megatrain_rng"], cpu_state)
    assert torch.equal(saved["megatrain_cuda_rng"], device_state)

    torch.manual_seed(123)  # draw elsewhere: loading must bring the saved states back
    strategy.load_model_state_dict(strategy.load_checkpoint(tmp_path / "ckpt"))
    assert torch.equal(torch.get_rng_state(), cpu_state)
    assert len(restored) == 1 and torch.equal(restored[0][0], device_state)
    assert restored[0][1] == torch.device("cuda", 0)

    loaded = strategy.load_checkpoint(tmp_path / "ckpt")
    del loaded["megatrain_cuda_rng"]
    torch.manual_seed(123)
    strategy.load_model_state_dict(loaded)
    assert torch.equal(torch.get_rng_state(), cpu_state) and len(restored) == 1
