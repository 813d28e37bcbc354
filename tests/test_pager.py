"""The trace and the pager's slots: replay, Belady eviction, invalidation, bounded residency."""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future

import pytest
import torch
from conftest import resident_at_replay, run_pass
from torch import nn

from megatrain_lightning.engine.blocks import discover_blocks
from megatrain_lightning.engine.host_views import HostViews
from megatrain_lightning.engine.pager import Pager
from megatrain_lightning.engine.slots import SlotLayout
from megatrain_lightning.engine.trace import Trace, UpdateCadence
from megatrain_lightning.store.host import HostStore
from megatrain_lightning.telemetry.stats import EngineStats


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(8, 8, bias=False)


def _store(blocks: int = 3) -> HostStore:
    net = nn.Sequential(*[Layer() for _ in range(blocks)])
    store = HostStore(discover_blocks(net, block_classes=[Layer]))
    for b in range(blocks):
        store.read(b, "param").fill_(b)
    return store


def _pager(num_slots: int, depth: int = 0, blocks: int = 3) -> Pager:
    store = _store(blocks)
    layout = SlotLayout(store.blocks, torch.float32)
    return Pager(store, torch.device("cpu"), layout, [(layout.nbytes, num_slots)], depth, EngineStats())


def _host_views() -> HostViews:
    return HostViews(_store(), EngineStats())


# The store's version gate holds alike for slot copies and for zero-copy views of the store.
GATED = pytest.mark.parametrize("make", [lambda: _pager(num_slots=1), _host_views], ids=["slots", "views"])


def test_trace_replays_and_detects_deviations():
    trace = Trace()
    trace.begin_pass("train")
    for access in [(0, False), (1, False), (1, True), (0, True)]:
        trace.access(access)
    assert not trace.following  # nothing recorded yet
    trace.begin_pass("train")
    trace.access((0, False))
    assert trace.following and trace.upcoming() == [(1, False), (1, True), (0, True)]
    assert not trace.is_last_use(0)
    trace.access((1, False))
    trace.access((1, True))
    assert trace.is_last_use(1)
    trace.access((2, True))  # not what was recorded
    assert not trace.following and trace.upcoming() == [] and trace.deviations == 1
    trace.begin_pass("eval")  # kinds keep their own recordings
    assert not trace.following


def test_replay_evicts_the_block_needed_farthest_in_the_future():
    pager = _pager(num_slots=2)
    order = [0, 1, 2, 0, 1, 2]
    assert run_pass(pager, order) == [0, 1, 2, 0, 1, 2]
    block_bytes = pager.store.blocks[0].numel * 4  # 64 weights, padded
    before = pager.stats.h2d_bytes
    assert run_pass(pager, order) == [0, 1, 2, 0, 1, 2]
    # The pass starts with 1 and 2 cached. Belady: 0 evicts 2 (needed after 1), 1 hits, 2 evicts 1,
    # 0 hits, 1 evicts 0 (never needed again), 2 hits: three loads. LRU would load all six.
    assert (pager.stats.h2d_bytes - before) // block_bytes == 3
    assert pager.stats.peak_slot_bytes == 2 * block_bytes


def test_prefetch_runs_ahead_within_the_free_slots():
    pager = _pager(num_slots=3, depth=2)
    resident = resident_at_replay(pager, [0, 1, 2])
    assert resident == {0, 1, 2}  # blocks 1 and 2 were requested before they were needed


def test_closing_frees_the_slots():
    """An engine outlives its run (the trainer holds it until collected): its device memory must not."""
    pager = _pager(num_slots=2)
    run_pass(pager, [0, 1, 2])
    slots = [weakref.ref(slot.buf) for slot in pager._slots]
    pager.close()
    assert pager.nbytes == 0 and all(slot() is None for slot in slots)


def test_a_change_announced_to_the_store_makes_the_cached_copy_stale():
    pager = _pager(num_slots=3)
    assert run_pass(pager, [0, 1]) == [0, 1]
    pager.store.read(0, "param").fill_(7)
    assert run_pass(pager, [0]) == [0]  # still the cached copy: nobody said it changed
    with pager.store.rewriting(0) as flat:
        flat.fill_(8)
    assert run_pass(pager, [0, 1]) == [8, 1]  # only block 0 is loaded again


@GATED
def test_a_load_waits_for_the_announced_update_and_a_failed_one_is_never_read(make):
    pager = make()
    assert run_pass(pager, [0]) == [0]
    update: Future = Future()
    pager.store.will_change(0, update)
    seen: list[float] = []
    loader = threading.Thread(target=lambda: seen.extend(run_pass(pager, [0])), daemon=True)
    loader.start()
    loader.join(timeout=0.2)
    assert loader.is_alive() and not seen  # waits for the update instead of reading the old copy
    pager.store._buffer(0, "param").fill_(5)  # what the update writes
    update.set_result(None)
    loader.join(timeout=10)
    assert seen == [5]
    failed: Future = Future()
    pager.store.will_change(0, failed)
    failed.set_exception(OSError("injected update failure"))
    with pytest.raises(OSError, match="injected update failure"):
        run_pass(pager, [0])


@GATED
def test_a_block_that_changes_while_in_use_is_an_error(make):
    pager = make()
    pager.begin_pass("train")
    pager.acquire(0, backward=False)
    pager.store.will_change(0)
    with pytest.raises(RuntimeError, match="changed while in use"):
        pager.release(0)


def test_update_cadence_learns_the_accumulation_window():
    cadence = UpdateCadence()
    predicted = []
    for updates in [False, False, False, True] * 3:  # accumulate_grad_batches=4
        cadence.record(updates)
        predicted.append(cadence.next_updates())
    # Once one window has been seen, the pass before each update pass predicts it, and only that one.
    assert predicted[4:] == [False, False, True, False, False, False, True, False]
