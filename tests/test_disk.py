"""The disk tier: files under offload_dir, a bounded host cache, identical training, clear failures."""

from __future__ import annotations

import errno
import gc
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import assert_same_training, fit, peak_rss_script, tiny_model
from lightning.fabric.utilities.exceptions import MisconfigurationException

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.engine.blocks import discover_blocks
from megatrain_lightning.store import sizing
from megatrain_lightning.store.disk import STORE_DIRNAME, DiskStore
from megatrain_lightning.store.io import BlockFile, StoreIOError
from megatrain_lightning.store.layout import Block
from megatrain_lightning.store.memory import ALIGNMENT
from megatrain_lightning.store.preflight import check_host_ram

CASES = [
    # arch, activation checkpointing, accumulate_grad_batches, gradient clipping
    ("llama", True, 4, ("norm", 1.0)),
    ("gpt2", False, 1, ("value", 0.02)),
    ("qwen2_moe", True, 1, None),
]


CHUNK_NUMEL = 2048  # 8 KB chunks: several per block, so every path runs chunk by chunk


def _budgets(model: torch.nn.Module) -> dict[str, float]:
    """Two blocks of slots, a host cache of a quarter of the model's fp32 weights, small chunks."""
    blocks = discover_blocks(model)
    largest = max(b.numel for b in blocks)
    cache = sum(4 * b.numel for b in blocks) / 4
    assert largest > 2 * CHUNK_NUMEL
    assert cache >= sizing.min_cache_bytes(largest, 1, CHUNK_NUMEL), "model too small for the chunks in use"
    return {
        "max_vram_gb": 8 * largest / 1e9,
        "max_cpu_gb": cache / 1e9,
        "io_chunk_mb": 4 * CHUNK_NUMEL / 2**20,
    }


@pytest.mark.parametrize(("arch", "checkpointing", "accumulate", "clip"), CASES)
def test_disk_tier_trains_exactly_like_plain(tmp_path, arch, checkpointing, accumulate, clip):
    model = tiny_model(arch, num_hidden_layers=40, hidden_size=32, intermediate_size=64)
    kwargs = {"accumulate_grad_batches": accumulate}
    if clip is not None:
        kwargs |= {"gradient_clip_algorithm": clip[0], "gradient_clip_val": clip[1]}
    strategy = MegaTrainStrategy(
        offload_dir=tmp_path, activation_checkpointing=checkpointing, keep_offload_dir=True, **_budgets(model)
    )
    plain = fit(model, "auto", steps=8, **kwargs)
    paged = fit(model, strategy, steps=8, **kwargs)
    assert_same_training(plain, paged)
    stats = paged.trainer.strategy.stats
    assert stats.peak_host_cache_bytes <= strategy.max_cpu_gb * 1e9
    assert stats.disk_read_bytes > 0 and stats.disk_write_bytes > 0
    manifest = json.loads((tmp_path / STORE_DIRNAME / "manifest.json").read_text())
    assert len(manifest["blocks"]) == len(paged.trainer.strategy.engine.blocks)
    assert {"param.bin", "exp_avg.bin", "exp_avg_sq.bin"} <= set(os.listdir(tmp_path / STORE_DIRNAME))


def test_buffered_io_where_o_direct_is_refused(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def open_refusing_direct(path, flags, *args, **kwargs):
        if str(path).endswith(".bin") and flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")  # as tmpfs on older kernels, or some FUSE mounts
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr("megatrain_lightning.store.io.os.open", open_refusing_direct)
    model = tiny_model("llama", num_hidden_layers=40, hidden_size=32, intermediate_size=64)
    plain = fit(model, "auto", steps=3)
    paged = fit(model, MegaTrainStrategy(offload_dir=tmp_path, **_budgets(model)), steps=3)
    assert_same_training(plain, paged)
    assert "refuses O_DIRECT" in caplog.text
    engine = paged.trainer.strategy.engine
    assert not engine.store._files.files["param"].direct
    engine.close()
    assert not os.path.exists(engine.store.directory), "closing the engine leaves the store's files"


_HOLD = "import sys, time; from megatrain_lightning.store.files import lock_directory as hold; hold(sys.argv[1]); print(1, flush=True); time.sleep(60)"  # fmt: skip


def test_offload_dir_in_use_by_another_run_or_model(tmp_path):
    blocks = discover_blocks(tiny_model("llama"))
    first = DiskStore(blocks, str(tmp_path), 1 << 24, kinds=["param"])
    with pytest.raises(StoreIOError, match="in use by another model of this process"):
        DiskStore(blocks, str(tmp_path), 1 << 24, kinds=["param"])
    first.close()
    (tmp_path / "megatrain_store").mkdir(exist_ok=True)  # closing removed it
    other = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path / "megatrain_store")], stdout=subprocess.PIPE
    )
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == b"1"
        with pytest.raises(StoreIOError, match=f"in use by pid {other.pid};"):
            DiskStore(blocks, str(tmp_path), 1 << 24, kinds=["param"])
    finally:
        other.kill()
        other.wait()
    DiskStore(blocks, str(tmp_path), 1 << 24, kinds=["param"]).close()


def test_offload_dir_that_cannot_be_used(tmp_path):
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(MisconfigurationException, match="not a directory"):
        MegaTrainStrategy(offload_dir=afile)
    with pytest.raises(MisconfigurationException, match="not a writable directory"):
        MegaTrainStrategy(offload_dir=afile / "sub")


def test_too_little_disk_space_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr("megatrain_lightning.store.preflight.free_disk_bytes", lambda path: 10 << 20)
    with pytest.raises(MisconfigurationException, match="GB are free"):
        fit(tiny_model("llama"), MegaTrainStrategy(offload_dir=tmp_path), steps=1)
    assert os.listdir(tmp_path) == []


def test_max_cpu_gb_above_available_ram(monkeypatch):
    monkeypatch.setattr("megatrain_lightning.store.preflight.available_ram_bytes", lambda: 1 << 30)
    with pytest.raises(MisconfigurationException, match="RAM available"):
        MegaTrainStrategy(max_cpu_gb=2)
    # On CUDA the gradient offload's staging is page-locked beside the cache: counted too.
    check_host_ram(1.0, staging_bytes=0)
    with pytest.raises(MisconfigurationException, match="plus 0.10 GB of gradient staging"):
        check_host_ram(1.0, staging_bytes=100_000_000)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_failed_write_stops_the_run_with_the_path(tmp_path, monkeypatch, code):
    write = BlockFile.write
    calls = {"n": 0}

    def failing_write(self, offset, buf):
        calls["n"] += 1
        if calls["n"] > 60:
            raise OSError(code, os.strerror(code))
        write(self, offset, buf)

    monkeypatch.setattr(BlockFile, "write", failing_write)
    model = tiny_model("llama", num_hidden_layers=40, hidden_size=32, intermediate_size=64)
    gc.collect()
    trainers_before = _live("Trainer")  # what other tests still hold
    with pytest.raises(StoreIOError, match=f"writing {tmp_path}.*failed") as info:
        fit(model, MegaTrainStrategy(offload_dir=tmp_path, **_budgets(model)), steps=20)
    if code == errno.ENOSPC:
        assert "larger disk" in str(info.value)
    del info
    gc.collect()
    # Teardown did not raise the failure a second time, so Lightning finished its own teardown: its
    # signal handlers, which hold the trainer and through it the model and its store, are gone.
    assert _live("Trainer") == trainers_before


def _live(type_name: str) -> int:
    return sum(type(o).__name__ == type_name for o in gc.get_objects())


MEMORY_SCRIPT = peak_rss_script(
    """
    import json, resource, sys, threading, time
    import lightning as L, psutil, torch
    import megatrain_lightning
    from megatrain_lightning.data import TextDataModule
    from megatrain_lightning.models import CausalLMModule
    from megatrain_lightning.presets import tiny_config

    folder, cache_gb = sys.argv[1], float(sys.argv[2])
    config = tiny_config("llama", hidden_size=512, intermediate_size=1376, num_hidden_layers=24,
                         num_attention_heads=8, num_key_value_heads=8)
    module = CausalLMModule(config, lr=1e-4, max_steps=2)  # built on meta in configure_model
    PEAK_RSS_WATCHER
    slots_gb = 2 * 4 * 3_200_000 / 1e9
    strategy = megatrain_lightning.MegaTrainStrategy(offload_dir=folder, max_cpu_gb=cache_gb, max_vram_gb=slots_gb,
                                                     io_chunk_mb=1)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0)
    trainer.fit(module, datamodule=TextDataModule(seq_len=64, batch_size=1))
    time.sleep(0.05)
    params = sum(p.numel() for p in module.parameters())
    print(json.dumps({"baseline": baseline, "peak": peak["rss"], "params": params,
                      "slots": strategy.engine.pager.nbytes,
                      "cache_peak": strategy.stats.peak_host_cache_bytes}))
    """
)

FIXED_OVERHEAD = 400e6  # activations, allocator slack, thread stacks, Lightning's own state


def test_a_model_three_times_the_cache_trains_within_the_memory_bound(tmp_path):
    cache_gb = 0.3
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path), str(cache_gb)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    weights_and_adam = 12 * figures["params"]
    assert weights_and_adam >= 3 * cache_gb * 1e9
    assert figures["cache_peak"] <= cache_gb * 1e9
    grown = figures["peak"] - figures["baseline"]
    assert grown <= cache_gb * 1e9 + figures["slots"] + FIXED_OVERHEAD, figures
    assert not (tmp_path / STORE_DIRNAME).exists(), "the store's files outlived the process"


def _page_store(tmp_path, cache_pages: int) -> DiskStore:
    """Four one-page blocks whose weights and ``exp_avg`` are on disk; the cache holds ``cache_pages``
    entries, at first blocks 2 and 3's ``exp_avg`` (needed by nothing predicted)."""
    blocks = [Block(index=i, name=f"b{i}", numel=ALIGNMENT // 4) for i in range(4)]
    store = DiskStore(blocks, str(tmp_path), cache_pages * ALIGNMENT, kinds=["param", "exp_avg"])
    for kind in ("param", "exp_avg"):
        for block in range(4):
            with store.pinned(block, kind, write=True) as buf:
                buf.fill_(block)
    store.flush()
    store.hint([(2, ("exp_avg",)), (3, ("exp_avg",))])
    for block in (2, 3):
        with store.pinned(block, "exp_avg"):
            pass
    store.hint([])
    store.stats.disk_read_bytes = 0
    return store


def test_cache_ranks_each_kind_by_its_own_next_use(tmp_path):
    store = _page_store(tmp_path, cache_pages=2)
    # Block 0's optimizer state is needed after block 1's weights: loading it must not evict them.
    store.hint([(0, ("param",)), (1, ("param",)), (0, ("exp_avg",))])
    for block in (0, 1):
        with store.pinned(block, "param") as buf:
            assert buf[0] == block
    assert store.stats.disk_read_bytes == 2 * ALIGNMENT
    with store.pinned(0, "exp_avg") as buf:
        assert buf[0] == 0
    assert store.stats.disk_read_bytes == 3 * ALIGNMENT
    store.close()


def test_a_claim_outranks_the_trace_and_later_demands(tmp_path):
    store = _page_store(tmp_path, cache_pages=2)
    store.hint([(0, ("param",)), (1, ("param",))])
    store.claim(2, ["param"])  # a submitted update: loaded now, evicting block 1 (needed last)
    with store.pinned(3, "param"):  # an unpredicted demand may evict block 0, not the claimed block 2
        pass
    with store.pinned(2, "param") as buf:
        assert buf[0] == 2
    assert store.stats.disk_read_bytes == 4 * ALIGNMENT  # 0, 1, 2, 3: the claimed block read once
    store.close()


def test_a_failed_read_ahead_stops_the_run_even_if_no_one_asks_for_that_block(tmp_path, monkeypatch):
    """A read that fails while loading ahead is never served, and the run stops at its next pin of any
    block instead of training on after a disk error; once the run is over, reads may be tried again."""
    store = _page_store(tmp_path, cache_pages=2)
    original = BlockFile.read

    def failing(self, offset, buf):
        if self.path.endswith("param.bin") and offset == 0:
            raise OSError(errno.EIO, "injected read failure")
        return original(self, offset, buf)

    monkeypatch.setattr(BlockFile, "read", failing)
    store.hint([(0, ("param",))])  # block 0 is read ahead, and fails
    store._workers.submit(lambda: None).result()  # the read has run
    for block in (0, 1):
        with (
            pytest.raises(StoreIOError, match=r"param\.bin.*injected read failure"),
            store.pinned(block, "param"),
        ):
            pass
    monkeypatch.undo()
    store.forget_read_failures()
    for block in (0, 1):
        with store.pinned(block, "param") as buf:
            assert buf[0] == block
    store.close()


def test_consumed_gradients_give_their_disk_space_back(tmp_path):
    """A step without a trace updates at its end, so most gradient sums spill to the sparse ``grad.bin``
    (a 7B run: 23 GB); once their updates consumed them the file's space is free again, and the chunks
    read as zeros (nothing stale)."""
    blocks = [Block(index=i, name=f"b{i}", numel=ALIGNMENT) for i in range(4)]  # 4 pages of fp32 each
    store = DiskStore(blocks, str(tmp_path), 4 * ALIGNMENT, kinds=["param", "grad"])
    grad_file = tmp_path / STORE_DIRNAME / "grad.bin"
    for block in range(4):
        with store.pinned(block, "grad", write=True) as buf:
            buf.fill_(block + 1)
    store.flush()  # the cache holds one block: at least three were written to disk
    spilled = grad_file.stat().st_blocks * 512
    assert spilled >= 3 * 4 * ALIGNMENT
    for block in range(4):
        store.discard(block, "grad")
    assert grad_file.stat().st_blocks * 512 == 0
    assert grad_file.stat().st_size >= 4 * 4 * ALIGNMENT  # the layout stays: only the space went back
    for block in range(4):
        with store.pinned(block, "grad") as buf:
            assert not buf.any()
    store.close()
