"""The host tier's bf16 shadow: under bf16 compute the weights that sit in the slots in bf16 cross the
link as the store's bf16 copy (2 bytes per parameter, no conversion on the device), refreshed by the
update in the same pass and rebuilt after any other write, so training stays bitwise Lightning's."""

from __future__ import annotations

import copy
import itertools
from concurrent.futures import Future

import lightning as L
import pytest
import torch
from conftest import (
    LossRecorder,
    Run,
    UserLM,
    assert_same_training,
    quiet_trainer,
    tiny_model,
    token_batches,
    user_fit,
)

from megatrain_lightning import MegaTrainStrategy, convert_checkpoint
from megatrain_lightning.engine import chaos
from megatrain_lightning.engine.blocks import discover_blocks
from megatrain_lightning.engine.pager import Pager
from megatrain_lightning.engine.slots import SlotLayout
from megatrain_lightning.optim import bf16, codecs, kernel
from megatrain_lightning.optim.quantized import quantized_adamw_
from megatrain_lightning.store.host import SHADOW, HostStore, shadow_index
from megatrain_lightning.store.layout import Block
from megatrain_lightning.store.memory import pages

STEPS = 4
ACCUMULATE = 2
MIXED = {"precision": "bf16-mixed", "accumulate_grad_batches": ACCUMULATE, "gradient_clip_val": 0.5}


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def plain(model) -> Run:
    return user_fit(model, "auto", steps=STEPS, **MIXED)


def _bytes_per_fetch(layout, block: int) -> int:
    """Each parameter (with the alignment padding after it in the store) at 2 bytes if it is bf16 on the
    device, else 4."""
    spec = layout.blocks[block]
    order = sorted(range(len(spec.params)), key=lambda i: spec.params[i].offset)
    ends = [spec.params[i].offset for i in order[1:]] + [spec.numel]
    return sum(
        (end - spec.params[i].offset) * layout.dtypes[block][i].itemsize
        for i, end in zip(order, ends, strict=True)
    )


def _assert_shadows_current(store: HostStore) -> None:
    """Every block's shadow is marked current and equals its weights rounded (without a rebuild)."""
    assert store.has_shadow
    for block in range(len(store.blocks)):
        runs = store.shadow_runs(block)
        if not runs:
            continue
        assert store.shadow_is_current(block), block
        weights = store.read(block, "param")
        with store.pinned(block, SHADOW) as shadow:
            for a, b in runs:
                start = shadow_index(runs, a)
                assert torch.equal(shadow[start : start + b - a], weights[a:b].to(torch.bfloat16)), block


class StepBytes(L.Callback):
    """After each optimizer step, once the pager's prefetches are done: ``h2d_bytes`` and the fetches so far."""

    def __init__(self, loads: list[int]) -> None:
        self.loads, self.marks = loads, [(0, 0)]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % ACCUMULATE == 0:
            pager = trainer.strategy.engine.pager
            pager._worker.submit(lambda: None).result()  # one worker: every queued prefetch is done
            self.marks.append((trainer.strategy.stats.h2d_bytes, len(self.loads)))


@pytest.mark.parametrize(
    ("max_slots", "chunk_mb"),
    [(None, 16), (2, 16), (2, 0.004)],
    ids=["all_resident", "two_slots", "small_chunks"],
)
def test_bf16_mixed_fetches_the_shadow_and_trains_bitwise_like_lightnings(
    model, plain, max_slots, chunk_mb, monkeypatch
):
    """With clipping and accumulation, on the slot path: losses and weights bitwise plain Lightning's
    ``bf16-mixed``; each step copies to the device exactly 2 bytes per bf16 parameter and 4 per fp32 one
    of every block it fetched; the shadows equal the trained weights rounded; the store counts them.
    ``small_chunks``: store chunks of 1024 elements, so fetches and updates cut runs and parameters."""
    loads: list[int] = []
    load = Pager._load

    def recorded(self, slot, block, finish):
        loads.append(block)
        return load(self, slot, block, finish)

    monkeypatch.setattr(Pager, "_load", recorded)
    kwargs = {"zero_copy": False, "io_chunk_mb": chunk_mb}
    if max_slots:
        slot = SlotLayout(discover_blocks(copy.deepcopy(model)), torch.bfloat16, mixed=True).nbytes
        kwargs["max_vram_gb"] = max_slots * slot / 1e9
    steps = StepBytes(loads)
    run = user_fit(model, MegaTrainStrategy(**kwargs), steps=STEPS, callbacks=[steps], **MIXED)
    assert_same_training(plain, run)
    engine = run.trainer.strategy.engine
    layout, store = engine.pager.layout, engine.store
    if max_slots:
        assert engine.pager.num_slots == max_slots
    assert max(len(store.spans(b)) for b in range(len(store.blocks))) > (20 if chunk_mb < 1 else 0)
    assert len(steps.marks) == STEPS + 1
    for step, ((bytes0, loads0), (bytes1, loads1)) in enumerate(itertools.pairwise(steps.marks)):
        fetched = loads[loads0:loads1]
        assert fetched and bytes1 - bytes0 == sum(_bytes_per_fetch(layout, b) for b in fetched), step
    bf16_elements = [sum(b - a for a, b in runs) for runs in layout.shadow_runs]
    fp32_only = sum(4 * (layout.blocks[b].numel) for b in loads)
    assert sum(bf16_elements) > 0 and engine.stats.h2d_bytes < fp32_only  # the shadow halves the link bytes
    _assert_shadows_current(store)
    shadow_bytes = sum(pages(2 * n) for n in bf16_elements if n)
    assert store.nbytes(SHADOW) == shadow_bytes
    assert engine.stats.host_bytes >= store.nbytes("param") + shadow_bytes


def test_the_disk_tier_keeps_no_shadow_and_reads_fp32(model, plain, tmp_path, monkeypatch):
    """The disk tier keeps today's path: no shadow, 4 bytes per parameter read for every fetch (the slots
    convert), and still bitwise Lightning's."""
    loads: list[int] = []
    load = Pager._load
    monkeypatch.setattr(
        Pager,
        "_load",
        lambda self, slot, block, finish: loads.append(block) or load(self, slot, block, finish),
    )
    run = user_fit(model, MegaTrainStrategy(offload_dir=str(tmp_path / "offload")), steps=STEPS, **MIXED)
    assert_same_training(plain, run)
    engine = run.trainer.strategy.engine
    engine.pager.close()
    assert not engine.store.has_shadow
    assert loads and engine.stats.h2d_bytes == sum(4 * engine.blocks[b].numel for b in loads)


@pytest.mark.parametrize(
    ("compression", "precision", "chunk_mb"),
    [("int8", "bf16-mixed", 16), ("int4", "bf16-mixed", 0.004), ("none", "bf16-true", 16)],
)
def test_the_shadow_path_equals_slots_converting_the_master(
    model, compression, precision, chunk_mb, monkeypatch
):
    """With quantized moments (the kernel writes the shadow in its pass), and under ``bf16-true`` (every
    weight in the shadow), the run equals, bitwise, the same run whose slots convert the fp32 master (no
    shadow), and the shadows end current."""
    trainer = {**MIXED, "precision": precision, "gradient_clip_val": None}  # updates during backward
    strategy = {"zero_copy": False, "optimizer_compression": compression, "io_chunk_mb": chunk_mb}
    with_shadow = user_fit(model, MegaTrainStrategy(**strategy), steps=STEPS, **trainer)
    store = with_shadow.trainer.strategy.engine.store
    if compression != "none":  # some parameters with quantized moments are in the shadow
        assert any(
            runs and runs[0][0] < block.large_numel
            for block, runs in ((b, store.shadow_runs(b.index)) for b in store.blocks)
        )
    else:
        assert all(store.shadow_runs(b.index) == [(0, b.numel)] for b in store.blocks)
    _assert_shadows_current(store)
    define = HostStore.define_shadow
    monkeypatch.setattr(HostStore, "define_shadow", lambda self, runs, joined=False: define(self, None))
    without = user_fit(model, MegaTrainStrategy(**strategy), steps=STEPS, **trainer)
    assert not without.trainer.strategy.engine.store.has_shadow
    assert_same_training(without, with_shadow)


def _fit(module, strategy, steps: int, batches, ckpt_path=None) -> Run:
    recorder = LossRecorder()
    trainer = quiet_trainer(strategy, steps, [recorder], **MIXED)
    torch.manual_seed(1)
    trainer.fit(
        module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None), ckpt_path=ckpt_path
    )
    return Run(module, trainer, recorder.losses)


@pytest.mark.parametrize("source", ["plain", "megatrain"])
def test_resuming_into_a_trained_module_reads_the_checkpoint_not_a_stale_shadow(model, source, tmp_path):
    """A module whose shadows are current for other weights resumes from a checkpoint (Lightning's file
    through ``load_state_dict``, or megatrain's directory) exactly as plain Lightning resumes: the load
    left the shadows stale and the first fetch rebuilt them."""
    batches = token_batches(2 * ACCUMULATE)  # one epoch: two steps, so step 2 is an epoch boundary
    first = _fit(
        UserLM(copy.deepcopy(model)), "auto" if source == "plain" else MegaTrainStrategy(), 2, batches
    )
    ckpt = str(tmp_path / "step2.ckpt")
    first.trainer.save_checkpoint(ckpt)
    plain_ckpt = ckpt
    if source == "megatrain":  # a directory: Lightning's own strategy resumes from its single-file form
        plain_ckpt = str(tmp_path / "step2-single.ckpt")
        convert_checkpoint(ckpt, plain_ckpt)
    expected = _fit(UserLM(copy.deepcopy(model)), "auto", 4, batches, plain_ckpt)
    module = UserLM(copy.deepcopy(model))
    other = _fit(module, MegaTrainStrategy(zero_copy=False), 2, token_batches(2 * ACCUMULATE, seed=7))
    _assert_shadows_current(other.trainer.strategy.engine.store)
    resumed = _fit(module, MegaTrainStrategy(zero_copy=False), 4, batches, ckpt)
    assert_same_training(expected, resumed)


def test_every_other_write_leaves_the_shadow_stale_and_a_read_rebuilds_it():
    """``rewriting`` (loading, initialization), a failed update and freed training state: the next read of
    the shadow gives the current weights rounded; an undefined shadow holds nothing."""
    store = HostStore([Block(0, "b", numel=1024)])
    store.define_shadow([[(0, 256), (512, 1024)]])
    assert store.layout(0, SHADOW) == (torch.bfloat16, 768)
    assert store.kind_span(0, SHADOW, (256, 768)) == (256, 512)

    def check(weights: torch.Tensor) -> None:
        with store.pinned(0, SHADOW) as shadow:
            expected = torch.cat([weights[:256], weights[512:]]).to(torch.bfloat16)
            assert torch.equal(shadow, expected)

    for value in (torch.randn(1024), torch.randn(1024)):
        with store.rewriting(0) as flat:
            flat.copy_(value)
        assert not store.shadow_is_current(0)
        check(value)
        assert store.shadow_is_current(0)
    failed: Future = Future()
    store.will_change(0, failed)
    with store.pinned(0, "param", write=True) as flat:
        flat.mul_(3)  # a half-done update that refreshed nothing
    failed.set_exception(RuntimeError("update failed"))
    store.accept_failed_changes()
    assert not store.shadow_is_current(0)
    check(store.read(0, "param"))
    store.release_all_but("param")
    assert store.nbytes(SHADOW) == 0
    check(store.read(0, "param"))
    with store.rewriting(0) as flat:
        flat.add_(1)
    running: Future = Future()  # an update announced after a read waited: the read's rebuild races it
    store.will_change(0, running)
    store._rebuild_shadow(0)
    assert not store.shadow_is_current(0)  # what it copied may be half updated
    running.set_result(None)
    check(store.read(0, "param"))
    store.define_shadow(None)
    assert not store.has_shadow and store.nbytes(SHADOW) == 0 and store.shadow_runs(0) == []


def test_a_shadow_is_not_current_while_it_is_filled(monkeypatch):
    """A new (zero) or half-filled shadow is stale until its fill ends, so an update never refreshes a part
    of it that the fill then leaves wrong, and a failed fill is rebuilt on the next read."""
    from megatrain_lightning.optim import bf16

    store = HostStore([Block(0, "b", numel=1024)])
    store.define_shadow([[(0, 1024)]])
    with store.rewriting(0) as flat:
        flat.copy_(torch.randn(1024))
    with store.pinned(0, SHADOW):
        assert store.shadow_is_current(0)
    # The shadow's buffer goes (not stale: absent); the next read makes it anew.
    store.release_all_but("param")
    fill = bf16.to_bf16_
    seen: list[bool] = []

    def failing_fill(src, dst, **kwargs):
        seen.append(store.shadow_is_current(0))
        raise KeyboardInterrupt

    monkeypatch.setattr(bf16, "to_bf16_", failing_fill)
    with pytest.raises(KeyboardInterrupt):
        store._rebuild_shadow(0)
    assert seen == [False] and not store.shadow_is_current(0)
    monkeypatch.setattr(bf16, "to_bf16_", fill)
    with store.pinned(0, SHADOW) as shadow:
        assert torch.equal(shadow, store.read(0, "param").to(torch.bfloat16))


@pytest.fixture(scope="module")
def compiled():
    if kernel.load_kernel() is None:
        pytest.skip(f"the compiled kernel is unavailable: {kernel.unavailable_reason()}")


def test_bf16_rounding_kernel_equals_the_fallback_and_torchs_conversion(compiled):
    """Round to nearest even on ties, overflow to infinity, subnormals, infinities: the compiled loop, the
    torch fallback and ``Tensor.to(torch.bfloat16)`` agree bit for bit; every NaN becomes 0x7fc0 in both."""
    generator = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (20_011,), generator=generator, dtype=torch.int64).to(
        torch.int32
    )
    x = torch.cat([
        bits.view(torch.float32),
        torch.randn(5000, generator=generator),
        torch.tensor([1.00390625, 1.01171875, -1.00390625, 3.3961e38, 3.4e38, 1e-40, -0.0, float("inf"), -float("inf"), float("nan")]),
    ])  # fmt: skip
    kernel_out, fallback = (
        torch.empty(len(x), dtype=torch.bfloat16),
        torch.empty(len(x), dtype=torch.bfloat16),
    )
    bf16.to_bf16_(x, kernel_out, num_threads=2, use_kernel=True)
    bf16.to_bf16_(x, fallback, use_kernel=False)
    assert torch.equal(kernel_out.view(torch.int16), fallback.view(torch.int16))
    numbers = ~x.isnan()
    assert torch.equal(kernel_out.view(torch.int16)[numbers], x[numbers].to(torch.bfloat16).view(torch.int16))
    assert set(kernel_out.view(torch.int16)[~numbers].tolist()) == {0x7FC0}


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_the_kernels_fused_shadow_equals_the_fallbacks(compiled, bits):
    """The quantized step with a shadow (full chunks, a tail, two steps): kernel and fallback give the same
    weights, moments and shadow, and the shadow is the weights rounded."""
    n = 40 * 256 + 37
    results = []
    for use_kernel in (True, False):
        generator = torch.Generator().manual_seed(bits)
        param, grad = torch.randn(n, generator=generator), torch.randn(n, generator=generator)
        state = [
            torch.zeros(codecs.code_bytes(n, "m", bits), dtype=torch.uint8),
            torch.zeros(codecs.num_scales(n, "m", bits)),
            torch.zeros(codecs.code_bytes(n, "v", bits), dtype=torch.uint8),
            torch.zeros(codecs.num_scales(n, "v", bits)),
        ]
        shadow = torch.zeros(n, dtype=torch.bfloat16)
        for step in (1, 2):
            quantized_adamw_(
                param, grad, *state, bits=bits, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                weight_decay=0.01, seed=3, offset=512, shadow=shadow, num_threads=2, use_kernel=use_kernel,
            )  # fmt: skip
        assert torch.equal(shadow, param.to(torch.bfloat16))
        results.append([param, *state, shadow.view(torch.int16)])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("compression", ["none", "int4"])
def test_random_delays_never_let_a_stale_shadow_through(model, compression):
    """Two slots, updates in worker threads during backward (racing the prefetch of the blocks they
    update), random delays at every hand-off between threads: the same weights and losses, bit for bit."""
    slot = SlotLayout(discover_blocks(copy.deepcopy(model)), torch.bfloat16, mixed=True).nbytes
    options = {"precision": "bf16-mixed", "accumulate_grad_batches": ACCUMULATE}

    def strategy() -> MegaTrainStrategy:
        return MegaTrainStrategy(
            zero_copy=False,
            max_vram_gb=2 * slot / 1e9,
            optimizer_threads=2,
            optimizer_compression=compression,
        )

    reference = user_fit(model, strategy(), steps=STEPS, **options)
    with chaos.enabled("seed=11,delay_ms=5,p=0.3") as injected:
        run = user_fit(model, strategy(), steps=STEPS, **options)
    assert sum(injected.hits.values()) > 50
    assert_same_training(reference, run)
    _assert_shadows_current(run.trainer.strategy.engine.store)
