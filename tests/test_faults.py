"""Faults in worker threads (block update, gradient add, block load, disk read/write): the error surfaces
with its own message, nothing stale is trained, no pin or future is left behind, and the next ``fit`` in
the same process starts clean and trains exactly like plain Lightning."""

from __future__ import annotations

import copy
import errno
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import LossRecorder, UserLM, assert_same_training, fit_module, tiny_model, user_fit

from megatrain_lightning import CPUAdamW, MegaTrainStrategy
from megatrain_lightning.engine import runtime as engine_module
from megatrain_lightning.engine.blocks import discover_blocks
from megatrain_lightning.engine.grads import HostGrads
from megatrain_lightning.engine.host_views import HostViews
from megatrain_lightning.engine.runtime import Engine
from megatrain_lightning.optim.rebuild import cpu_adamw_from
from megatrain_lightning.optim.updates import UpdateQueue
from megatrain_lightning.store.host import HostStore
from megatrain_lightning.store.io import BlockFile
from megatrain_lightning.telemetry.stats import EngineStats

STEPS = 3


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def plain(model):
    return user_fit(model, "auto", steps=STEPS)


def _failing(original: Callable, when: Callable[..., bool], message: str) -> Callable:
    """``original`` that raises ``RuntimeError(message)`` whenever ``when(*args)`` holds."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if when(*args, **kwargs):
            raise RuntimeError(message)
        return original(*args, **kwargs)

    return wrapper


def _stored_weights(engine: Engine) -> dict[str, torch.Tensor]:
    """The weights the store holds, by parameter name, read around the engine's waits."""
    return {
        name: engine.blocks[block].views(engine.store.read(block, "param"))[index].clone()
        for name, (block, index) in engine.locations.items()
    }


def _block_names(engine: Engine, block: int) -> list[str]:
    return [name for name, (b, _) in engine.locations.items() if b == block]


def _assert_clean(engine: Engine) -> None:
    if isinstance(engine.pager, HostViews):  # zero copy: no slots, no loads
        assert not engine.pager._held, "a failed run left a block pinned"
    else:
        assert all(slot.pins == 0 for slot in engine.pager._slots), "a failed run left a slot pinned"
        deadline = time.monotonic() + 10  # a prefetch in flight when the run stopped ends (failing fast)
        while any(slot.loading for slot in engine.pager._slots) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(slot.loading for slot in engine.pager._slots), "a block load never finished"
    assert not engine.grads._pending, "a failed run left a gradient offload pending"
    if engine.optimizer is not None:
        assert all(future.done() for future in engine.optimizer.updates.futures())


def _assert_unchanged_and_clean(engine: Engine, block: int, initial: dict[str, torch.Tensor]) -> None:
    """The failed block's weights are what they were before the run, and nothing is left pending."""
    stored = _stored_weights(engine)
    for name in _block_names(engine, block):
        assert torch.equal(stored[name], initial[name]), name
    _assert_clean(engine)


def _fails(
    module: UserLM,
    strategy: MegaTrainStrategy,
    match: str,
    error: type = RuntimeError,
    recorder: LossRecorder | None = None,
) -> list[float]:
    """Fit ``module`` expecting ``error``; the losses of the micro-batches that completed."""
    recorder = recorder or LossRecorder()
    with pytest.raises(error, match=match):
        fit_module(module, strategy, steps=STEPS, callbacks=[recorder])
    return recorder.losses


def _then_fits_clean(model, plain, module, engine, fresh_dir=None, **strategy_kwargs) -> None:
    """After a failure: a fresh module trains exactly like plain Lightning, and so does the failed module
    itself, continuing from what its store holds."""
    fresh = strategy_kwargs | ({"offload_dir": fresh_dir} if fresh_dir else {})
    assert_same_training(plain, user_fit(model, MegaTrainStrategy(**fresh), steps=STEPS))
    start = UserLM(copy.deepcopy(model))
    start.load_state_dict(_stored_weights(engine))
    reference = fit_module(start, "auto", steps=STEPS)
    assert_same_training(reference, fit_module(module, MegaTrainStrategy(**strategy_kwargs), steps=STEPS))


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_failed_block_update(model, plain, monkeypatch, tmp_path, tier):
    kwargs = {"offload_dir": tmp_path / "failed"} if tier == "disk" else {}
    module, strategy = UserLM(copy.deepcopy(model)), MegaTrainStrategy(**kwargs)
    initial = {k: v.clone() for k, v in module.state_dict().items()}
    failing = 1
    update = _failing(CPUAdamW._update, lambda self, block, *a: block == failing, "injected update failure")
    monkeypatch.setattr(CPUAdamW, "_update", update)
    losses = _fails(module, strategy, "injected update failure")
    assert len(losses) <= 1, "a step ran after a block's update had failed"
    engine = strategy.engine
    _assert_unchanged_and_clean(engine, failing, initial)
    monkeypatch.undo()
    if tier == "host":  # the next fit may also change the settings (a new slot budget: a new pager)
        kwargs = {"max_vram_gb": 3.2e-4}
    _then_fits_clean(model, plain, module, engine, tmp_path / "fresh" if tier == "disk" else None, **kwargs)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["inline", "offload_thread"])
def test_failed_gradient_add(model, plain, monkeypatch, asynchronous):
    if asynchronous:  # the CUDA path's worker thread, on the CPU
        monkeypatch.setattr(engine_module, "HostGrads", functools.partial(HostGrads, asynchronous=True))
    module, strategy = UserLM(copy.deepcopy(model)), MegaTrainStrategy()
    initial = {k: v.clone() for k, v in module.state_dict().items()}
    failing = 2
    add = _failing(HostGrads._add, lambda self, block, *a: block == failing, "injected gradient failure")
    monkeypatch.setattr(HostGrads, "_add", add)
    assert _fails(module, strategy, "injected gradient failure") == []
    engine = strategy.engine
    _assert_unchanged_and_clean(engine, failing, initial)
    monkeypatch.undo()
    _then_fits_clean(model, plain, module, engine)


def test_failed_block_load_leaves_no_pin(model, plain, monkeypatch):
    slots = {"max_vram_gb": 3.2e-4, "zero_copy": False}  # loads into slots (zero copy loads nothing)
    module, strategy = UserLM(copy.deepcopy(model)), MegaTrainStrategy(**slots)
    loads = []

    def from_the_third_load_of_block_1(self, block, kind, write=False, span=None):
        if kind == "param" and not write and block == 1:
            loads.append(block)
            return len(loads) >= 3  # every later load too: a demand load meets it (a prefetch is retried)
        return False

    monkeypatch.setattr(
        HostStore,
        "pinned",
        _failing(HostStore.pinned, from_the_third_load_of_block_1, "injected load failure"),
    )
    _fails(module, strategy, "injected load failure")
    engine = strategy.engine
    _assert_clean(engine)
    assert all(
        slot.ready is None or slot.ready.exception() is None for slot in engine.pager._resident.values()
    )
    monkeypatch.undo()
    _then_fits_clean(model, plain, module, engine, **slots)


def test_failed_announcement_before_an_update(model, plain, monkeypatch):
    """The update's announcement to the store (its disk-cache claim) raising: the update's future still
    resolves, so the teardown's wait does not hang."""
    module, strategy = UserLM(copy.deepcopy(model)), MegaTrainStrategy()
    claim = _failing(HostStore.claim, lambda self, block, kinds: block == 3, "injected claim failure")
    monkeypatch.setattr(HostStore, "claim", claim)
    assert _fails(module, strategy, "injected claim failure") == []
    _assert_clean(strategy.engine)
    monkeypatch.undo()
    _then_fits_clean(model, plain, module, strategy.engine)


@pytest.mark.parametrize("io", ["read", "write"])
def test_failed_disk_io(model, plain, monkeypatch, tmp_path, io):
    # Two slots and a small cache: blocks and their optimizer state go to disk and come back every step.
    kwargs = {"offload_dir": tmp_path / "failed", "max_cpu_gb": 1.4e-3, "max_vram_gb": 3.2e-4}
    module, strategy = UserLM(copy.deepcopy(model)), MegaTrainStrategy(**kwargs)
    calls, recorder, completed = [], LossRecorder(), []

    def failing(original):
        def io_call(self, offset, buf):
            calls.append(offset)
            if len(calls) == 5:
                completed.append(len(recorder.losses))
                raise OSError(errno.EIO, f"injected {io} failure")
            return original(self, offset, buf)

        return io_call

    monkeypatch.setattr(BlockFile, io, failing(getattr(BlockFile, io)))
    losses = _fails(module, strategy, f"injected {io} failure", error=OSError, recorder=recorder)
    assert completed and len(losses) <= completed[0] + 1, "training went on after a failed transfer"
    _assert_clean(strategy.engine)
    monkeypatch.undo()
    if io == "read":  # a failed read is never served again: the same module trains on
        _then_fits_clean(model, plain, module, strategy.engine, tmp_path / "fresh", **kwargs)
        return
    # A failed write leaves the store incomplete: that module's store refuses further work, clearly.
    with pytest.raises(OSError, match=f"injected {io} failure"):
        fit_module(module, MegaTrainStrategy(**kwargs), steps=STEPS)
    fresh = kwargs | {"offload_dir": tmp_path / "fresh"}
    assert_same_training(plain, user_fit(model, MegaTrainStrategy(**fresh), steps=STEPS))


def test_offload_thread_trains_exactly(model, plain, monkeypatch):
    """The asynchronous offload path (on CUDA: the copy stream's worker) submits updates from its thread."""
    monkeypatch.setattr(engine_module, "HostGrads", functools.partial(HostGrads, asynchronous=True))
    assert_same_training(plain, user_fit(model, MegaTrainStrategy(), steps=STEPS))


# -- units --


def _host_grads(model) -> tuple[HostGrads, list]:
    blocks = discover_blocks(copy.deepcopy(model))
    store = HostStore(blocks)
    return HostGrads(store, torch.device("cpu"), EngineStats(), asynchronous=True), blocks


def test_an_earlier_failed_gradient_add_is_raised_by_flush(model, monkeypatch):
    grads, blocks = _host_grads(model)
    add = _failing(HostGrads._add, lambda self, block, *a: block == 0, "injected gradient failure")
    monkeypatch.setattr(HostGrads, "_add", add)
    ready = []
    for block in (0, 1):  # the failure is not the newest offload
        spec = blocks[block].params[0]
        grads.offload(
            block, {0: torch.ones(spec.shape)}, final=True, then=functools.partial(ready.append, block)
        )
    with pytest.raises(RuntimeError, match="injected gradient failure"):
        grads.flush()
    assert ready == [1] and grads.present(1) == [0]
    grads.flush()  # raised once; the next window starts clean after ``clear``
    grads.clear()
    assert grads.present(1) == []
    grads.close()


def test_a_failing_announcement_resolves_the_block_future(model, monkeypatch):
    module = UserLM(copy.deepcopy(model))
    engine = Engine(module, discover_blocks(module), engine_module.EngineConfig(device=torch.device("cpu")))
    claim = _failing(HostStore.claim, lambda *args: True, "injected claim failure")
    monkeypatch.setattr(HostStore, "claim", claim)
    locate = {id(p): engine.locations[n] for n, p in module.named_parameters(remove_duplicate=False)}
    optimizer = cpu_adamw_from(
        torch.optim.AdamW(module.parameters()), store=engine.store, grads=engine.grads, locate=locate
    )
    with pytest.raises(RuntimeError, match="injected claim failure"):
        optimizer._submit(0)
    waited: list[BaseException] = []

    def wait() -> None:
        try:
            optimizer.wait(0)
        except RuntimeError as err:
            waited.append(err)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(timeout=10)
    assert not waiter.is_alive(), "a load of the block would wait forever"
    assert len(waited) == 1 and "injected claim failure" in str(waited[0])
    with pytest.raises(RuntimeError, match="injected claim failure"):
        engine.weights.read_param(0, 0)  # the store's readers do not wait forever either
    optimizer.close()  # already raised: not raised again
    engine.close()


def test_wait_for_room_reads_the_pending_updates_under_the_lock():
    """The offload thread (CUDA) submits updates while the backward pass looks for room: that look must
    hold the queue's lock, or the dict changes size under it. The submitter is made to strike in the
    middle of the look; under the lock it waits until the look is over."""
    queue, gate = UpdateQueue(threads=1, stats=EngineStats()), threading.Event()
    for block in range(queue.max_queued + 1):  # pending (held at the gate), more than max_queued
        queue.submit(block, lambda future: None, functools.partial(gate.wait, 10))
    submitter = threading.Thread(target=queue.submit, args=(99, lambda future: None, lambda: None))
    struck = []

    class Racing(dict):
        def values(self):
            values = iter(dict.values(self))
            yield next(values)
            if not submitter.is_alive() and not struck:  # once, in the first look
                submitter.start()
                submitter.join(0.2)  # under the lock it cannot insert before the look is over
                struck.append(not submitter.is_alive())
            yield from values

    queue._pending = Racing(queue._pending)
    threading.Timer(0.3, gate.set).start()  # room appears once the held updates run
    queue.wait_for_room()
    assert struck == [False], "the submitter changed the pending updates during the look"
    submitter.join(10)
    queue.wait_all()
    assert queue.submitted(99)
    queue.close()
