"""Where the compute device is the host (CPU, host tier), blocks compute on the store's own weights (in
bf16, on its bf16 shadow where a slot holds bf16): no slot, no copy, and results bitwise those of the slot
path. Worker threads leave the compute thread's OpenMP size alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import lightning as L
import pytest
import torch
from conftest import tiny_model, user_fit

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.engine.threads import bulk_threads, update_workers
from megatrain_lightning.optim.updates import UpdateQueue
from megatrain_lightning.telemetry.stats import EngineStats


class WeightAddresses(L.Callback):
    """Records, at each call of the first decoder layer's up projection and norm, whether their weights lie
    in the store's buffers (the weights' or the bf16 shadow's) and their dtypes."""

    def __init__(self) -> None:
        self.in_store: list[bool] = []
        self.dtypes: set[tuple[torch.dtype, torch.dtype]] = set()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = trainer.strategy.engine
        name = next(n for n in engine.locations if n.endswith("layers.0.mlp.up_proj.weight"))
        block = engine.locations[name][0]
        kinds = ["param", "shadow"] if engine.store.has_shadow else ["param"]
        flats = [engine.store.read(block, kind) for kind in kinds]
        ranges = [(flat.data_ptr(), flat.data_ptr() + flat.nbytes) for flat in flats]
        layer = pl_module.model.model.layers[0]

        def record(module: torch.nn.Module, args: object) -> None:
            for weight in (layer.mlp.up_proj.weight, layer.input_layernorm.weight):
                self.in_store.append(any(start <= weight.data_ptr() < end for start, end in ranges))
            self.dtypes.add((layer.mlp.up_proj.weight.dtype, layer.input_layernorm.weight.dtype))

        layer.mlp.up_proj.register_forward_pre_hook(record)


@pytest.mark.parametrize(
    ("precision", "checkpointing", "dtypes"),
    [
        ("32-true", False, (torch.float32, torch.float32)),
        ("32-true", True, (torch.float32, torch.float32)),
        ("bf16-mixed", False, (torch.bfloat16, torch.float32)),  # the shadow; the fp32 norm from the weights
        ("bf16-mixed", True, (torch.bfloat16, torch.float32)),
        ("bf16-true", False, (torch.bfloat16, torch.bfloat16)),
    ],
)
def test_zero_copy_binds_the_store_and_trains_bitwise_as_the_slots(precision, checkpointing, dtypes):
    model, runs = tiny_model("llama"), {}
    for zero_copy in (True, False):
        addresses = WeightAddresses()
        strategy = MegaTrainStrategy(activation_checkpointing=checkpointing, zero_copy=zero_copy)
        clipping = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}
        runs[zero_copy] = (
            user_fit(model, strategy, steps=3, callbacks=[addresses], precision=precision, **clipping),
            addresses,
        )
    (views, seen_views), (slots, seen_slots) = runs[True], runs[False]
    assert seen_views.in_store and all(seen_views.in_store)  # forward and recompute read the store itself
    assert seen_slots.in_store and not any(seen_slots.in_store)
    assert seen_views.dtypes == seen_slots.dtypes == {dtypes}
    assert views.trainer.strategy.stats.h2d_bytes == 0
    assert views.trainer.strategy.stats.peak_slot_bytes == 0
    assert slots.trainer.strategy.stats.h2d_bytes > 0
    assert views.losses == slots.losses
    expected = slots.state_dict()
    for name, value in views.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_bf16_weights_and_their_shadow_share_one_buffer_counted_once():
    run = user_fit(tiny_model("llama"), MegaTrainStrategy(), steps=2, precision="bf16-mixed")
    store = run.trainer.strategy.engine.store
    numel = sum(b.numel for b in store.blocks)
    shadow = sum(store.layout(b.index, "shadow")[1] for b in store.blocks)
    pages = 4096 * len(store.blocks)  # a buffer of its own is whole pages
    assert 0 < shadow < numel  # the decoder layers' linear weights, not the embedding, norms or head
    assert store.nbytes("shadow") == 2 * shadow
    assert 4 * numel <= store.nbytes("param") <= 4 * numel + pages
    # weights, their shadow, Adam's m and v, and the gradient sums of a block or two
    assert 12 * numel + 2 * shadow <= store.nbytes() < 16 * numel + 2 * shadow


def test_worker_threads_run_single_threaded_and_leave_the_compute_thread_its_size():
    # A fresh process with two OpenMP threads: the workers start before the main thread's first parallel op.
    script = textwrap.dedent(
        """
        import torch
        from megatrain_lightning.engine.grads import HostGrads
        from megatrain_lightning.optim.updates import UpdateQueue
        from megatrain_lightning.store.host import HostStore
        from megatrain_lightning.telemetry.stats import EngineStats

        queue = UpdateQueue(1, EngineStats(), torch.device("cpu"))
        grads = HostGrads(HostStore([]), torch.device("cpu"), EngineStats(), asynchronous=True)
        inside = [pool.submit(torch.get_num_threads).result() for pool in (queue._pool, grads._worker)]
        x = torch.randn(512, 512)
        x @ x
        print(inside, torch.get_num_threads())
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["[1,", "1]", "2"]


def test_bulk_work_takes_the_cores_compute_leaves(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 9)
    assert bulk_threads(torch.device("cpu"), 2) == 1  # compute uses every core
    assert bulk_threads(torch.device("cuda"), 2) == 4  # 8 cores beside the compute thread
    assert bulk_threads(torch.device("cuda"), 16) == 1


def test_updates_run_in_the_compute_thread_where_compute_uses_every_core():
    assert update_workers(torch.device("cpu"), host_tier=True, requested=None) == 0
    assert update_workers(torch.device("cpu"), host_tier=True, requested=2) == 2  # as asked
    assert update_workers(torch.device("cpu"), host_tier=False, requested=None) == 1  # disk I/O to overlap
    assert update_workers(torch.device("cuda"), host_tier=True, requested=None) == 1
    queue, ran_in = UpdateQueue(0, EngineStats()), []
    queue.submit(0, lambda future: None, lambda: ran_in.append(threading.current_thread()))
    assert ran_in == [threading.current_thread()] and all(f.done() for f in queue.futures())

    def fails() -> None:
        raise OSError("injected update failure")

    queue.submit(1, lambda future: None, fails)  # reported where updates are waited for, as from a worker
    with pytest.raises(OSError, match="injected update failure"):
        queue.wait_all()
    queue.close()
