"""Slots sized per block size: a large embedding or head gets slots of its own size instead of setting the
size of every layer slot, so a budget a little over the model holds the whole model."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from conftest import assert_same_training, resident_at_replay, run_pass, tiny_model, token_batches, user_fit
from torch import nn

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.engine.blocks import discover_blocks
from megatrain_lightning.engine.pager import Pager
from megatrain_lightning.engine.slots import SlotLayout, serial_blocks, slot_pools
from megatrain_lightning.store.host import HostStore
from megatrain_lightning.telemetry.stats import EngineStats

VOCAB = 4096  # the embedding and the head are each about 7 decoder layers of the tiny Llama


@pytest.mark.parametrize(
    ("blocks", "budget", "pools"),
    [
        ([4, 1, 1, 4, 2], None, ((4, 2), (2, 1), (1, 2))),  # no budget: a slot per block
        ([4, 1, 1, 4, 2], 12, ((4, 2), (2, 1), (1, 2))),  # a budget that holds every block
        ([4, 1, 1, 4, 2], 3.9, ()),  # below the largest block: nothing
        ([4, 4, 1, 1, 1, 1], 8, ((4, 2),)),  # the two largest first: one computes while the next loads
        ([4, 1, 1, 1, 1], 7, ((4, 1), (1, 3))),  # then the slots that fit, to the least served size
        # 4, 4 first; then a 2 (none of its six has a slot) and the 1 fit in the 3 bytes left
        ([4, 4, 2, 2, 2, 2, 2, 2, 1], 11, ((4, 2), (2, 1), (1, 1))),
        # 8 and a 3 first; then 1s until their share of slots (2 of 4) is the 3s' (1 of 2); the 3 on the tie
        ([8, 3, 3, 1, 1, 1, 1], 16.5, ((8, 1), (3, 2), (1, 2))),
    ],
)
def test_the_budget_buys_slots_per_block_size(blocks, budget, pools):
    assert slot_pools(blocks, budget) == pools


class Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.w = nn.Linear(width, width, bias=False)


def _pager(widths: list[int], slots: dict[int, int], depth: int = 0) -> Pager:
    """A pager over blocks of ``width x width`` fp32 weights filled with their index; ``slots``: how many
    slots of each width's block size."""
    blocks = discover_blocks(nn.Sequential(*[Layer(w) for w in widths]), block_classes=[Layer])
    store = HostStore(blocks)
    for b in range(len(widths)):
        store.read(b, "param").fill_(b)
    layout = SlotLayout(store.blocks, torch.float32)
    pools = [(4 * width * width, count) for width, count in slots.items()]
    return Pager(store, torch.device("cpu"), layout, pools, depth, EngineStats())


def test_a_small_block_takes_its_own_slot_then_a_larger_one_never_a_smaller():
    pager = _pager([32, 16, 16], {32: 1, 16: 1})  # blocks of 4 KB, 1 KB, 1 KB
    pager.begin_pass("train")
    first = pager.acquire(1, backward=False)
    assert first.numel() == 1024  # the empty 4 KB slot was free too: the smaller slot that fits
    second = pager.acquire(2, backward=False)  # its size's slot is pinned: the larger one
    assert second.numel() == 4096 and pager.view(2, 0, second)[0, 0].item() == 2
    with pytest.raises(RuntimeError, match="all 1 device slots that hold block 0 are pinned"):
        pager.acquire(0, backward=False)  # the 1 KB slot is free, but too small
    pager.release(1)
    pager.release(2)
    assert pager.view(0, 0, pager.acquire(0, backward=False))[0, 0].item() == 0


def test_belady_evicts_across_the_pools_a_block_fits():
    pager = _pager([32, 16, 16], {32: 1, 16: 1})
    order = [0, 1, 2, 1, 2, 0]
    assert run_pass(pager, order) == [0, 1, 2, 1, 2, 0]
    before = pager.stats.h2d_bytes
    assert run_pass(pager, order) == [0, 1, 2, 1, 2, 0]
    # The replay starts with 0 in the 4 KB slot and 2 in the 1 KB slot. Block 1 evicts 0 (needed last,
    # after 2) from the large slot; 2, 1 and 2 hit; 0 loads again into the large slot: two loads.
    assert pager.stats.h2d_bytes - before == 1024 + 4096


def test_prefetch_fills_a_pool_past_a_block_that_must_wait_for_another():
    pager = _pager([32, 32, 16], {32: 1, 16: 1}, depth=2)
    resident = resident_at_replay(pager, [0, 1, 2])
    # Block 1 needs the large slot that 0 holds; 2, needed after it, was fetched ahead into the small one.
    assert resident == {0, 2}
    assert run_pass(pager, [1, 2]) == [1, 2]


class H2DPerStep(L.Callback):
    """Bytes copied to the device in each training step and each validation batch."""

    def __init__(self) -> None:
        self.train: list[int] = []
        self.val: list[int] = []
        self._start = 0

    def _stats(self, trainer: L.Trainer) -> int:
        return trainer.strategy.stats.h2d_bytes

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = self._stats(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train.append(self._stats(trainer) - self._start)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._start = self._stats(trainer)

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ) -> None:
        self.val.append(self._stats(trainer) - self._start)


def _device_bytes(model: nn.Module, precision: str) -> int:
    """The model's bytes on the compute device: fp32; under bf16-mixed the Linear weights in bf16 (what
    autocast casts), the embedding and the norms in fp32 as Lightning keeps them."""
    if precision == "32-true":
        return 4 * sum(p.numel() for p in model.parameters())
    half = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(p.numel() * (2 if id(p) in half else 4) for p in model.parameters())


@pytest.fixture(scope="module")
def large_vocab_model() -> nn.Module:
    model = tiny_model("llama", vocab_size=VOCAB)  # an untied head: two blocks of 7 layers each
    assert not model.config.tie_word_embeddings
    return model


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_budget_of_the_model_keeps_it_resident_and_trains_bitwise(large_vocab_model, precision):
    model = large_vocab_model
    model_bytes = _device_bytes(model, precision)
    budget = 1.1 * model_bytes
    layout = SlotLayout(
        discover_blocks(model),
        torch.bfloat16 if precision == "bf16-mixed" else torch.float32,
        mixed=precision == "bf16-mixed",
    )
    layer = layout.block_bytes[1]
    assert layout.nbytes > 5 * layer  # the embedding (and the fp32 head) is several decoder layers
    assert len(layout.block_bytes) * layout.nbytes > budget  # uniform slots of the largest block: no fit
    steps, kwargs = 4, {"precision": precision, "vocab": VOCAB}
    plain = user_fit(model, "auto", steps=steps, **kwargs)
    counter = H2DPerStep()
    strategy = MegaTrainStrategy(max_vram_gb=budget / 1e9, zero_copy=False)
    paged = user_fit(model, strategy, steps=steps, callbacks=[counter], **kwargs)
    assert_same_training(plain, paged)
    engine = paged.trainer.strategy.engine
    assert engine.pager.num_slots == len(engine.blocks)  # a slot per block, each of its own size
    assert engine.pager.nbytes == sum(layout.block_bytes) <= budget
    # The first step copies every block once (its padding too), each later step again once, after the
    # block's update: nothing is evicted.
    once = counter.train[0]
    assert model_bytes <= once <= sum(layout.block_bytes)
    assert counter.train == [once] * steps
    paged.trainer.limit_val_batches = 1.0
    paged.trainer.validate(
        paged.module,
        torch.utils.data.DataLoader(token_batches(3, vocab=VOCAB), batch_size=None),
        verbose=False,
    )
    assert counter.val == [once, 0, 0]  # the blocks updated last fetched once; then, unchanged, never


@pytest.mark.parametrize(
    ("pools", "serial"),
    [
        (((4, 1), (3, 1), (1, 1)), 1),  # every 3 fits the 4's slot and its own: only the largest waits
        (((4, 1), (1, 1)), 4),  # the 3s share the one slot of the 4: each waits for the one before
        (((4, 2),), 0),
    ],
)
def test_blocks_that_fit_one_slot_are_counted(pools, serial):
    assert serial_blocks([4, 3, 3, 3, 1], pools) == serial


def test_a_budget_where_the_layers_fit_one_slot_warns_with_the_budget_that_overlaps(large_vocab_model):
    """A 7B Llama in bf16-mixed has an fp32 embedding larger than a decoder layer: two slots of a layer's
    size buy one embedding slot and no second slot that holds a layer, so the layers load one after
    another. The warning says so and names the budget of the two largest blocks, which does not warn."""
    layout = SlotLayout(discover_blocks(large_vocab_model), torch.float32)
    overlap = sum(sorted(layout.block_bytes)[-2:])

    def said(budget: float) -> list[str]:
        strategy = MegaTrainStrategy(max_vram_gb=budget / 1e9, zero_copy=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            user_fit(large_vocab_model, strategy, steps=1, vocab=VOCAB)
        return [str(w.message) for w in caught if "fit only one device slot" in str(w.message)]

    (warning,) = said(layout.nbytes + layout.block_bytes[1] // 2)
    assert f"of the {len(layout.block_bytes)} blocks fit only one device slot" in warning
    assert f"`max_vram_gb={overlap / 1e9:.3g}`" in warning
    assert said(overlap) == []
