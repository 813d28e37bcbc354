"""CPUAdamW: bitwise torch's Adam/AdamW over the store's flat buffers, and its schedule of updates."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import assert_same_training, fit, tiny_model
from torch import nn

from megatrain_lightning import CPUAdamW, MegaTrainStrategy
from megatrain_lightning.engine.blocks import discover_blocks
from megatrain_lightning.engine.grads import HostGrads
from megatrain_lightning.optim.clipping import GradNorms
from megatrain_lightning.optim.rebuild import cpu_adamw_from
from megatrain_lightning.store.host import HostStore
from megatrain_lightning.store.memory import pages
from megatrain_lightning.telemetry.stats import EngineStats


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 16, bias=False)
        self.norm = nn.LayerNorm(16)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))


def _setup(params_of, **options):
    """The same parameters in a plain torch optimizer and in a CPUAdamW over a store."""
    torch.manual_seed(0)
    net = Net()
    blocks = discover_blocks(net, block_classes=[Layer])
    store = HostStore(blocks)
    grads = HostGrads(store, torch.device("cpu"), EngineStats())
    locate = {}
    for block in blocks:
        for site in block.sites:
            for binding in site.bindings:
                param = binding.owner._parameters[binding.attr]
                locate[id(param)] = (block.index, binding.index)
                block.views(store.read(block.index, "param"))[binding.index].copy_(param.detach())
    groups = params_of(net)
    torch_cls = options.pop("cls", torch.optim.AdamW)
    reference = torch_cls(groups, **options)
    ours = cpu_adamw_from(torch_cls(params_of(net), **options), store=store, grads=grads, locate=locate)
    return net, reference, ours, grads, locate


def _view(store, kind, block, index):
    return store.blocks[block].views(store.read(block, kind))[index]


def _groups(net):
    decay = [p for n, p in net.named_parameters() if p.ndim == 2]
    no_decay = [p for n, p in net.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 1e-2}]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"foreach": True},
        {"fused": True},
        {"cls": torch.optim.Adam, "weight_decay": 0.05},
        {"maximize": True, "betas": (0.8, 0.9), "eps": 1e-6},
    ],
)
def test_steps_equal_torch_bitwise_including_parameters_without_gradients(options):
    net, reference, ours, grads, locate = _setup(_groups, lr=3e-3, **options)
    params = list(net.parameters())
    for step in range(6):
        torch.manual_seed(step)
        # Some parameters get no gradient in some steps (as unrouted MoE experts): torch skips them.
        skip = {i for i in range(len(params)) if (i + step) % 4 == 0}
        for block in range(3):
            found = {}
            for i, p in enumerate(params):
                if locate[id(p)][0] == block and i not in skip:
                    found[locate[id(p)][1]] = torch.randn_like(p)
            grads.offload(block, found, final=True, then=lambda: None)
        for i, p in enumerate(params):
            block, index = locate[id(p)]
            p.grad = None if i in skip else _view(grads.store, "grad", block, index).clone()
        reference.step()
        reference.zero_grad()
        ours.step()
        ours.zero_grad()
    for p in params:
        block, index = locate[id(p)]
        assert torch.equal(_view(ours.store, "param", block, index), p.detach())
    # The state dict has torch's format: a torch optimizer loads it and holds the same numbers.
    state = ours.state_dict()
    expected = reference.state_dict()
    assert state["state"].keys() == expected["state"].keys()
    for key, entry in expected["state"].items():
        for name, value in entry.items():
            assert torch.equal(state["state"][key][name], value), (key, name)


def test_state_dict_round_trip():
    net, reference, ours, grads, locate = _setup(_groups, lr=3e-3)
    grads.offload(0, {0: torch.ones(32, 16)}, final=True, then=lambda: None)
    ours.step()
    saved = {k: v for k, v in ours.state_dict().items()}
    saved["state"] = {k: {n: t.clone() for n, t in e.items()} for k, e in saved["state"].items()}
    ours.store.read(0, "exp_avg").zero_()
    ours.load_state_dict(saved)
    again = ours.state_dict()
    assert all(torch.equal(again["state"][k]["exp_avg"], e["exp_avg"]) for k, e in saved["state"].items())
    with pytest.raises(ValueError, match="param groups"):
        ours.load_state_dict({"state": {}, "param_groups": saved["param_groups"][:1]})


def _record_submissions(monkeypatch) -> list[bool]:
    """For each block update submitted: was the closure (forward + backward) still running?"""
    during_closure: list[bool] = []
    submit = CPUAdamW._submit

    def spy(self, block):
        during_closure.append(self._in_step)
        submit(self, block)

    monkeypatch.setattr(CPUAdamW, "_submit", spy)
    return during_closure


def test_updates_overlap_the_backward_pass(monkeypatch):
    during_closure = _record_submissions(monkeypatch)
    run = fit(tiny_model("llama"), MegaTrainStrategy(), steps=4)
    blocks = len(run.trainer.strategy.engine.blocks)
    # From the first step (before any trace), every block updates while the backward is still running.
    assert during_closure == [True] * 4 * blocks


def test_clipping_defers_updates_until_the_norm_is_known(monkeypatch):
    during_closure = _record_submissions(monkeypatch)
    fit(tiny_model("llama"), MegaTrainStrategy(), steps=4, gradient_clip_val=1.0)
    assert during_closure and not any(during_closure)


def test_norm_clipping_takes_each_blocks_norms_in_the_backward(monkeypatch):
    """Clipped by norm, each block's norms are taken as its sums become final in the stepping backward (from
    the first step), so the global norm is known and the deferred updates start the moment the backward
    ends. Bitwise plain Lightning."""
    after_backward: list[bool] = []  # per block whose norms were taken: after the backward (in `total`)?
    total, of_block = GradNorms.total, GradNorms._of_block

    def spy_total(self, order, clamp):
        self.in_total = True
        try:
            return total(self, order, clamp)
        finally:
            self.in_total = False

    def spy_of_block(self, block, clamp):
        after_backward.append(getattr(self, "in_total", False))
        return of_block(self, block, clamp)

    model = tiny_model("llama")
    plain = fit(model, "auto", steps=4, gradient_clip_val=0.05)
    monkeypatch.setattr(GradNorms, "total", spy_total)
    monkeypatch.setattr(GradNorms, "_of_block", spy_of_block)
    paged = fit(model, MegaTrainStrategy(), steps=4, gradient_clip_val=0.05)
    assert_same_training(plain, paged)
    blocks = len(paged.trainer.strategy.engine.blocks)
    assert after_backward == [False] * 4 * blocks


@pytest.mark.parametrize(
    "options, whole",
    [({}, False), ({"accumulate_grad_batches": 2}, True), ({"gradient_clip_val": 1.0}, True)],
    ids=["one micro-batch", "accumulating", "clipping"],
)
def test_gradient_sums_exist_from_a_backward_to_their_update(options, whole):
    """The host tier's gradient buffers go back to a pool once their update used them: with updates in the
    backward, a buffer per block size serves every block; when all sums must wait for the step's end
    (accumulation, clipping) the pool holds the whole model's."""
    run = fit(tiny_model("llama"), MegaTrainStrategy(), steps=3, **options)
    store = run.trainer.strategy.engine.store
    held = store.nbytes("grad", "grad_pass")
    sizes = {block.numel: pages(4 * block.numel) for block in store.blocks}
    if whole:
        assert held >= sum(pages(4 * block.numel) for block in store.blocks)
    else:
        assert 0 < held <= sum(sizes.values())
    assert run.trainer.strategy.stats.host_bytes >= store.nbytes("param", "exp_avg", "exp_avg_sq") + held


@pytest.mark.parametrize(
    "chunk_mb, precision, whole",
    [(None, "32-true", True), (4096 / 2**20, "32-true", False), (None, "bf16-mixed", False)],
    ids=["fp32", "fp32-io_chunk_mb", "bf16-shadow"],
)
def test_the_host_tier_updates_whole_blocks_where_chunks_do_not_pay(chunk_mb, precision, whole):
    """All in RAM, a chunk bounds no memory and only cuts updates into more, smaller calls (bench_adamw:
    0.92 of torch's fused step in 16 MB chunks, 0.98 whole); ``io_chunk_mb`` still cuts them, and so does a
    bf16 shadow, whose refresh reads each chunk the update just wrote while it is in cache."""
    strategy = MegaTrainStrategy(io_chunk_mb=chunk_mb, zero_copy=precision == "32-true")
    store = fit(tiny_model("llama"), strategy, steps=1, precision=precision).trainer.strategy.engine.store
    assert (store.chunk_numel == max(b.numel for b in store.blocks)) == whole  # else the io chunk
    assert store.has_shadow == (precision == "bf16-mixed")


def test_a_block_is_never_fetched_before_its_update_finished(monkeypatch):
    update = CPUAdamW._update

    def slow_update(self, block, hparams, clip):
        time.sleep(0.02)
        update(self, block, hparams, clip)

    model = tiny_model("llama")
    plain = fit(model, "auto", steps=6)
    monkeypatch.setattr(CPUAdamW, "_update", slow_update)
    paged = fit(model, MegaTrainStrategy(optimizer_threads=2), steps=6)
    assert_same_training(plain, paged)
    assert paged.trainer.strategy.stats.optimizer_wait_s > 0
