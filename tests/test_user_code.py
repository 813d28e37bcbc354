"""User code touching the model the ways users' code does: exact, or a clear megatrain error."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from conftest import UserLM, assert_same_training, quiet_trainer, tiny_model, token_batches, user_fit
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from megatrain_lightning import CPUAdamW, MegaTrainStrategy
from megatrain_lightning.engine.outside_uses import reached_by_this_backward
from megatrain_lightning.engine.placeholders import ParamPlaceholder, weight_source_of
from megatrain_lightning.store.memory import pages


class GradModeLayer(nn.Module):
    """A layer whose forward depends on the grad mode (as Doge's does, by a few ulps)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.linear(x))
        return x + (y if torch.is_grad_enabled() else y * 1.001)


class ToyLM(nn.Module):
    """A plain-PyTorch causal LM that reads a parameter's device outside its module, as Llama-4 does."""

    def __init__(self, vocab: int = 256, width: int = 32, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(GradModeLayer(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> SimpleNamespace:
        h = self.embed(input_ids.to(self.embed.weight.device))
        assert self.head.weight.dtype == torch.float32
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss, logits=logits)


def _toy() -> ToyLM:
    torch.manual_seed(0)
    return ToyLM()


@pytest.mark.parametrize("checkpointing", [True, False])
def test_grad_mode_dependent_forward_and_device_reads_are_exact(checkpointing):
    plain = user_fit(_toy(), "auto")
    strategy = MegaTrainStrategy(block_classes=[GradModeLayer], activation_checkpointing=checkpointing)
    assert_same_training(plain, user_fit(_toy(), strategy))


class SharedLayersLM(ToyLM):
    """Its layers called again at later positions (weights shared across depth, as in ALBERT)."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> SimpleNamespace:
        h = self.embed(input_ids)
        for i in (0, 1, 0, 1):
            h = self.layers[i](h)
        logits = self.head(h)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss, logits=logits)


class ContextLayer(nn.Module):
    """A layer that reads a context beside its input ``uses`` times (0 to 3), as a decoder layer's
    cross-attention reads the encoder's output (keys and values); its third use is elementwise (in fp32
    under autocast, where the linear ones cast it to bf16)."""

    def __init__(self, uses: int, width: int = 32) -> None:
        super().__init__()
        self.uses = uses
        self.linear, self.add, self.gate = (nn.Linear(width, width) for _ in range(3))

    def forward(self, h: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        z = self.linear(h)
        if self.uses >= 1:
            z = z + self.add(context)
        if self.uses >= 2:
            z = z * torch.sigmoid(self.gate(context))
        if self.uses >= 3:
            z = z + 0.5 * context
        return h + torch.tanh(z)


class PrefixHolder(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.prefix = nn.Parameter(torch.randn(1, 1, width) * 0.5)


class ContextLM(ToyLM):
    """Every layer gets one context: computed from the tokens, or (``prefix``) a learned prefix handed to
    each layer's call as it is."""

    def __init__(self, uses: tuple[int, ...], prefix: bool) -> None:
        super().__init__(layers=0)
        self.layers = nn.ModuleList(ContextLayer(n) for n in uses)
        self.context = PrefixHolder() if prefix else nn.Embedding(256, 32)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> SimpleNamespace:
        h = self.embed(input_ids)
        is_prefix = isinstance(self.context, PrefixHolder)
        context = self.context.prefix if is_prefix else torch.tanh(self.context(input_ids.flip(1)))
        for layer in self.layers:
            h = layer(h, context)
        logits = self.head(h)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss, logits=logits)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("checkpointing", [True, False], ids=["recompute", "once"])
@pytest.mark.parametrize("prefix", [False, True], ids=["computed", "learned-prefix"])
def test_a_tensor_every_layer_takes_gets_its_gradient_as_autograd_sums_it(prefix, checkpointing, precision):
    """Layers reading it three times, twice, once and not at all: its gradient summed use by use in
    autograd's order (engine/shared_inputs.py), under autocast too (a call reads it through a view); a
    learned prefix handed to the calls as it is trains (it took no gradient: its placeholder went into the
    calls)."""
    torch.manual_seed(0)
    model = ContextLM(uses=(3, 1, 0, 2, 3), prefix=prefix)
    plain = user_fit(model, "auto", precision=precision)
    strategy = MegaTrainStrategy(block_classes=[ContextLayer], activation_checkpointing=checkpointing)
    assert_same_training(plain, user_fit(model, strategy, precision=precision))


@pytest.mark.parametrize("checkpointing", [True, False])
def test_a_block_called_several_times_in_one_step_trains_as_plain(checkpointing):
    torch.manual_seed(0)
    model = SharedLayersLM(layers=2)
    plain = user_fit(model, "auto")
    strategy = MegaTrainStrategy(block_classes=[GradModeLayer], activation_checkpointing=checkpointing)
    assert_same_training(plain, user_fit(model, strategy))


class StatefulLayer(nn.Module):
    """A layer whose forward updates state: BatchNorm's running statistics, spectral norm's vectors."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.utils.parametrizations.spectral_norm(nn.Linear(width, width))
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(self.linear(x).transpose(1, 2)).transpose(1, 2))


class CountingLayer(nn.Module):
    """A step count one submodule advances and another reads (one tensor, two buffers), and a buffer
    its first forward uses up (deletes)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        count = torch.zeros(())
        self.counter, self.scaled = nn.Module(), nn.Linear(width, width)
        self.counter.register_buffer("count", count)
        self.scaled.register_buffer("count", count)
        self.register_buffer("once", torch.full((width,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "once" in self._buffers:
            x = x * self._buffers.pop("once")
        self.counter.count.add_(1.0)
        return x + torch.tanh(self.scaled(x) * self.scaled.count)


@pytest.mark.parametrize("layer", [StatefulLayer, CountingLayer])
def test_state_a_forward_updates_is_updated_once_per_step_despite_the_recompute(layer):
    model = _toy()
    model.layers = nn.ModuleList(layer(32) for _ in range(2))
    plain = user_fit(model, "auto")
    paged = user_fit(model, MegaTrainStrategy(block_classes=[layer]))
    assert_same_training(plain, paged)  # the buffers too: running statistics, power-iteration vectors


class ClampingLayer(GradModeLayer):
    """A layer that keeps its weight within bounds in its own forward, as a max-norm layer does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.linear.weight.clamp_(-0.1, 0.1)
        return super().forward(x)


@pytest.mark.parametrize("tier", ["host", "slots", "disk"])
def test_weights_a_forward_changes_in_place_are_kept_as_in_plain_pytorch(tier, tmp_path):
    """``nn.Embedding(max_norm=...)`` renormalizes the rows it looks up; a layer clamps its weight: where
    the block computes on a copy (a slot, the disk tier), the store takes the change."""
    model = tiny_model("llama")
    model.model.embed_tokens.max_norm = 0.1
    toy = _toy()
    toy.layers = nn.ModuleList(ClampingLayer(32) for _ in range(2))
    for name, built, block_classes in [("llama", model, None), ("toy", toy, [ClampingLayer])]:
        options = {
            "slots": {"zero_copy": False},
            "disk": {"offload_dir": tmp_path / name, "max_cpu_gb": 0.01},
        }
        strategy = MegaTrainStrategy(block_classes=block_classes, **options.get(tier, {}))
        assert_same_training(user_fit(built, "auto"), user_fit(built, strategy))


class DecayingLayer(GradModeLayer):
    """A layer that shrinks its weight in each forward: a change a recompute would make twice."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.linear.weight.mul_(0.9)
        return super().forward(x)


@pytest.mark.parametrize("zero_copy", [True, False])
def test_a_forward_change_the_recompute_repeats_differently_is_refused(zero_copy):
    toy = _toy()
    toy.layers = nn.ModuleList(DecayingLayer(32) for _ in range(2))
    strategy = MegaTrainStrategy(block_classes=[DecayingLayer], zero_copy=zero_copy)
    with pytest.raises(RuntimeError, match="its recompute in backward changed them again"):
        user_fit(toy, strategy)
    exact = MegaTrainStrategy(
        block_classes=[DecayingLayer], zero_copy=zero_copy, activation_checkpointing=False
    )
    assert_same_training(user_fit(toy, "auto"), user_fit(toy, exact))


def test_weights_a_forward_changes_in_a_bf16_copy_are_refused():
    toy = _toy()
    toy.layers = nn.ModuleList(ClampingLayer(32) for _ in range(2))
    strategy = MegaTrainStrategy(block_classes=[ClampingLayer], zero_copy=False)
    with pytest.raises(RuntimeError, match="changes its weights in its forward .* bf16 copy"):
        user_fit(toy, strategy, precision="bf16-mixed")


class BuildsInConfigureModel(UserLM):
    """A user's module that builds a plain-PyTorch model in ``configure_model``."""

    def __init__(self, _: None) -> None:
        super().__init__(None)

    def configure_model(self) -> None:
        if self.model is None:
            self.model = ToyLM()


def test_a_plain_pytorch_model_built_in_configure_model_starts_from_the_plain_builds_weights():
    plain = user_fit(None, "auto", module_cls=BuildsInConfigureModel)
    paged = user_fit(
        None, MegaTrainStrategy(block_classes=[GradModeLayer]), module_cls=BuildsInConfigureModel
    )
    assert_same_training(plain, paged)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_dropout_is_replayed_exactly_in_the_recompute(arch):
    dropout = (
        {"attention_dropout": 0.1}
        if arch == "llama"
        else {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}
    )
    model = tiny_model(arch, **dropout)
    plain = user_fit(model, "auto")
    paged = user_fit(model, MegaTrainStrategy(activation_checkpointing=True))
    assert_same_training(plain, paged)


def test_placeholders_report_the_compute_device_and_the_dtype_plain_lightning_shows():
    run = user_fit(tiny_model("llama"), MegaTrainStrategy(), steps=1)
    params = list(run.module.parameters())
    assert all(isinstance(p, ParamPlaceholder) for p in params)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params)
    assert all(isinstance(p, nn.Parameter) for p in params)


class WeightNormLogger(L.Callback):
    """Reads every parameter's values, as weight-statistics callbacks do."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        total = sum(float(p.detach().float().pow(2).sum()) for p in pl_module.parameters())
        self.norms.append(total)


def test_a_callback_reading_weights_sees_the_store():
    model = tiny_model("llama")
    plain_logger, paged_logger = WeightNormLogger(), WeightNormLogger()
    plain = user_fit(model, "auto", callbacks=[plain_logger])
    paged = user_fit(model, MegaTrainStrategy(), callbacks=[paged_logger])
    assert_same_training(plain, paged)
    assert plain_logger.norms == paged_logger.norms


class L2PenaltyLM(UserLM):
    """An L2 penalty on every weight in the loss, as users write one: each weight used once outside its layer."""

    def training_step(self, batch, batch_idx):
        l2 = sum(p.pow(2).sum() for p in self.parameters())
        return super().training_step(batch, batch_idx) + 1e-2 * l2


class WeightPenaltiesLM(L2PenaltyLM):
    """More terms on the same weights: a pull of a view of one towards its starting values (EWC's form), a
    weight's norm, logged too."""

    def on_fit_start(self) -> None:
        self.start = self.model.lm_head.weight.detach().clone()

    def training_step(self, batch, batch_idx):
        pull = (self.model.lm_head.weight[:8] - self.start[:8]).pow(2).sum()
        norm = self.model.get_input_embeddings().weight.norm()
        self.log("embedding_norm", norm)
        return super().training_step(batch, batch_idx) + 1e-1 * pull + 1e-3 * norm


class PenaltyBeforeTheStepLM(UserLM):
    """The penalty's graph built before `training_step` (in a batch-start hook), used in its loss."""

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self.penalty = self.model.lm_head.weight.pow(2).sum()

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + 1e-2 * self.penalty


class TiedByFunctionLM(ToyLM):
    """Model code that uses a weight outside its module: the head is the embedding's weight, by `F.linear`."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> SimpleNamespace:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = F.linear(h, self.embed.weight)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss, logits=logits)


@pytest.mark.parametrize("tier", ["host", "slots", "disk"])
def test_weights_used_outside_their_layers_train_as_in_plain_pytorch(tier, tmp_path):
    """Their gradient, which autograd sums in the placeholder, joins the block's at the backward's end:
    bitwise the default strategy's where each weight is used once outside its layer, with accumulation and
    clipping too; within a rounding where used several times (autograd adds the layer's use in between)."""
    cases = [
        (tiny_model("llama"), L2PenaltyLM, None, {"accumulate_grad_batches": 2}, 0),
        (tiny_model("gpt2"), L2PenaltyLM, None, {"gradient_clip_val": 0.5}, 0),
        (TiedByFunctionLM(), UserLM, [GradModeLayer], {}, 0),
        (tiny_model("llama"), WeightPenaltiesLM, None, {"accumulate_grad_batches": 2}, 1e-6),
        (tiny_model("llama"), PenaltyBeforeTheStepLM, None, {"gradient_clip_val": 0.5}, 0),
    ]
    stores = []
    for case, (model, module_cls, block_classes, trainer_kwargs, tolerance) in enumerate(cases):
        options = {
            "slots": {"zero_copy": False},
            "disk": {"offload_dir": tmp_path / str(case), "max_cpu_gb": 0.01},
        }
        strategy = MegaTrainStrategy(block_classes=block_classes, **options.get(tier, {}))
        plain, paged = (
            user_fit(model, s, module_cls=module_cls, **trainer_kwargs) for s in ("auto", strategy)
        )
        assert_same_training(plain, paged, loss_rtol=tolerance, param_atol=tolerance)
        stores.append(weakref.ref(weight_source_of(paged.module)))
    # After `fit`, the trainer kept (so the engine too): a backward of the user's through a view.
    weight = paged.module.model.lm_head.weight
    paged.module.zero_grad()
    (weight[3] * 2.0).sum().backward()
    expected = torch.zeros(weight.shape)
    expected[3] = 2.0
    assert torch.equal(weight.grad, expected)
    del plain, paged, weight, strategy
    gc.collect()
    # Nothing of this keeps a model's store alive. Where the module holds a penalty's graph, autograd's nodes
    # (C++) hold its placeholders, which the first collection takes for roots: the second frees it.
    assert [stored() is None for stored in stores] == [True, True, True, True, False]
    gc.collect()
    assert all(stored() is None for stored in stores)


class WeightNormLogged(L.Callback):
    """A weight norm logged after each step as users write one: autograd on (Lightning's training loop), no
    `detach`; the step's backward never reaches it."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.log("weight_norm", torch.stack([p.norm() for p in pl_module.parameters()]).norm())


class HeadPenaltyLM(UserLM):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + 1e-2 * self.model.lm_head.weight.pow(2).sum()


@pytest.mark.parametrize(
    "module_cls, callbacks, held_back, given_outside",
    [
        (UserLM, [WeightNormLogged], set(), set()),
        (HeadPenaltyLM, [], set(), {"model.lm_head"}),
        (L2PenaltyLM, [], None, None),  # every block: its penalty's graph is built before the forward
        (PenaltyBeforeTheStepLM, [], {"model.lm_head"}, {"model.lm_head"}),
    ],
    ids=["weight-norm-logged", "head-penalty", "l2-penalty-on-every-weight", "penalty-before-the-forward"],
)
def test_only_a_use_the_backward_reaches_holds_its_blocks_update_back(
    module_cls, callbacks, held_back, given_outside, monkeypatch
):
    """A weight used outside its layer holds its block's update back to the step's end only where the
    step's backward brings it a gradient after the block's own (a penalty whose graph was built before the
    forward: autograd runs it after the layers): a norm logged after the last step, or a penalty added to
    the loss after the forward (autograd sums its gradient first), leave every update in the backward,
    overlapping it. Bitwise plain Lightning, the logged norm too."""
    submitted: list[tuple[int, bool]] = []  # (block, submitted while the closure still ran)
    submit = CPUAdamW._submit

    def spy(self, block):
        submitted.append((block, self._in_step))
        submit(self, block)

    model, steps = tiny_model("llama"), 4
    plain = user_fit(model, "auto", steps, module_cls=module_cls, callbacks=[c() for c in callbacks])
    monkeypatch.setattr(CPUAdamW, "_submit", spy)
    paged = user_fit(
        model, MegaTrainStrategy(), steps, module_cls=module_cls, callbacks=[c() for c in callbacks]
    )
    assert_same_training(plain, paged)
    assert paged.trainer.callback_metrics.keys() == plain.trainer.callback_metrics.keys()
    for key, value in plain.trainer.callback_metrics.items():
        assert torch.equal(paged.trainer.callback_metrics[key], value), key
    engine = paged.trainer.strategy.engine
    assert sorted(submitted) == sorted(
        (b.index, held_back is not None and b.name not in held_back)
        for b in engine.blocks
        for _ in range(steps)
    )
    # The gradient sums held: a buffer per block size serves the blocks updated in the backward (as without
    # the use), a block given a gradient from outside keeps its sum (plain holds it in `p.grad`; deferring
    # every update, the norm's run held the whole model's).
    sizes = {pages(4 * b.numel) for b in engine.blocks}
    held = sum(pages(4 * b.numel) for b in engine.blocks if given_outside is None or b.name in given_outside)
    assert engine.store.nbytes("grad", "grad_pass") <= sum(sizes) + held


def test_whether_a_backward_reaches_a_weight_is_answered_under_torch_autograd_grad_too():
    """A block's last use asks autograd whether the running backward reaches a weight used outside the
    block; `torch.autograd.grad` with respect to that weight refuses the question for leaves (torch's
    internal error before): the block then waits for the backward's end, as when it is reached."""
    weight, unused, x = (
        nn.Parameter(torch.ones(3)),
        nn.Parameter(torch.ones(3)),
        torch.ones(3, requires_grad=True),
    )
    answers = []

    class Asks(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, grad):
            answers.extend(reached_by_this_backward(p) for p in (weight, unused))
            return grad * 2

    torch.autograd.grad((Asks.apply(x) * weight).sum(), [x, weight])
    torch.autograd.grad((Asks.apply(x) * weight).sum(), [x])
    (Asks.apply(x) * weight).sum().backward()
    assert answers == [True, False, False, False, True, False]


class FreezeHeadAtBatch2(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 2:
            pl_module.model.lm_head.weight.requires_grad_(False)


def test_a_weight_frozen_after_a_callback_read_it_trains_as_plain():
    """The norm's read made the head a weight used outside its layer; frozen since, no gradient comes."""
    model = tiny_model("llama")
    plain, paged = (
        user_fit(model, strategy, 4, callbacks=[WeightNormLogged(), FreezeHeadAtBatch2()])
        for strategy in ("auto", MegaTrainStrategy())
    )
    assert_same_training(plain, paged)


class PeekingLayer(GradModeLayer):
    """A layer that computes with another layer's weight, which megatrain puts in another block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.peeked.weight.mean()


def test_a_weight_read_inside_another_blocks_call_is_refused_naming_block_classes():
    model = _toy()
    for layer in model.layers:
        layer.__class__ = PeekingLayer
        object.__setattr__(layer, "peeked", model.head)  # not a submodule: the head stays its own block
    with pytest.raises(
        RuntimeError, match="megatrain: `model.head.weight` was read inside the call of a layer"
    ):
        user_fit(model, MegaTrainStrategy(block_classes=[PeekingLayer]))


class ClampAfterEachStep(L.Callback):
    """Weight clipping between steps, as a max-norm constraint's or a WGAN critic's callback does."""

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        with torch.no_grad():
            for param in module.model.model.layers[0].mlp.parameters():
                param.clamp_(-0.02, 0.02)


def _edit_and_step_by_hand(module: UserLM) -> list[torch.Tensor]:
    """What users do to a trained model in place, then one step of their own optimizer on it; the losses."""
    model = module.model.model
    weight = model.layers[1].self_attn.q_proj.weight
    with torch.no_grad():
        assert weight.mul_(0.5) is weight
        weight.data.add_(1.0)
        weight[0] = 3.0
        weight.data[1:3, ::2] = 0.0
        nn.init.zeros_(model.norm.weight)
        torch._foreach_mul_(list(model.layers[0].parameters()), 2.0)
        model.layers[0].mlp.down_proj.weight.data = torch.full_like(
            model.layers[0].mlp.down_proj.weight, 0.01
        )
        vector = parameters_to_vector(model.layers[1].parameters())
        vector_to_parameters(vector * 0.9, model.layers[1].parameters())
        # Through views, as `nn.init.orthogonal_` and transformers' `_init_weights` (a padding row) write.
        torch.manual_seed(0)
        nn.init.orthogonal_(model.layers[0].mlp.up_proj.weight)
        model.embed_tokens.weight[0].zero_()
        row = model.layers[0].self_attn.k_proj.weight[2]
        model.layers[0].self_attn.k_proj.weight.view(-1)[5:9].add_(1.0)
        model.layers[0].self_attn.k_proj.weight.t()[0, 1:4] = 2.0
        model.layers[1].mlp.up_proj.weight.chunk(2)[1].mul_(0.5)
        down = model.layers[1].mlp.down_proj.weight
        torch._foreach_add_([down, down.data], 1.0)  # one parameter twice: both additions
        row.mul_(3.0)  # a view taken before the changes sees them, and writes through
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        weight.mul_(2.0)  # autograd on: refused by torch, as for a plain parameter
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    optimizer.zero_grad()
    batch = token_batches(2, seed=5)
    losses = [module(batch[0]).loss]
    losses[0].backward()
    optimizer.step()
    with torch.no_grad():
        losses.append(module(batch[1]).loss)
    return losses


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_in_place_changes_of_the_weights_are_kept_as_for_plain_parameters(tier, tmp_path):
    kwargs = {"offload_dir": tmp_path / "store", "max_cpu_gb": 0.01} if tier == "disk" else {}
    runs = [
        user_fit(tiny_model("llama"), strategy, steps=3, callbacks=[ClampAfterEachStep()])
        for strategy in ("auto", MegaTrainStrategy(**kwargs))
    ]
    assert_same_training(*runs)
    losses = [_edit_and_step_by_hand(run.module) for run in runs]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    assert_same_training(*runs)
    weight = runs[1].module.model.model.layers[0].mlp.up_proj.weight
    with pytest.raises(RuntimeError, match="megatrain: .*grad` assigned a tensor of shape"):
        weight.grad = torch.zeros(3)
    with pytest.raises(RuntimeError, match="megatrain: .*data` assigned a tensor of shape"):
        weight.data = torch.zeros(3)
    with pytest.raises(RuntimeError, match="megatrain keeps the parameter's shape, dtype and device"):
        weight.data = torch.zeros(weight.shape, dtype=torch.bfloat16)
    with pytest.raises(
        RuntimeError, match="cannot be replaced by another tensor's storage .*Tie weights before"
    ):
        weight.data = runs[1].module.model.model.layers[1].mlp.up_proj.weight.data


class ChangedBeforeBackwardLM(UserLM):
    """Changes a weight between the forward and the backward that needs it."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        with torch.no_grad():
            self.model.model.layers[0].mlp.up_proj.weight.mul_(2.0)
        return loss


def test_a_weight_changed_between_forward_and_backward_is_refused_as_by_pytorch():
    model = tiny_model("llama")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        user_fit(model, "auto", module_cls=ChangedBeforeBackwardLM)
    with pytest.raises(RuntimeError, match="megatrain: a weight of .*layers.0. was changed in place between"):
        user_fit(model, MegaTrainStrategy(), module_cls=ChangedBeforeBackwardLM)


def test_deepcopy_gives_a_plain_model_with_the_trained_weights():
    model = tiny_model("llama")
    plain = user_fit(model, "auto")
    paged = user_fit(model, MegaTrainStrategy())
    clone = copy.deepcopy(paged.module.model)
    assert not any(isinstance(p, ParamPlaceholder) for p in clone.parameters())
    assert clone.lm_head.weight is not clone.model.embed_tokens.weight  # untied stays untied
    ids = token_batches(1)[0]
    with torch.no_grad():
        expected = plain.module.model(input_ids=ids).logits
        assert torch.equal(clone(input_ids=ids).logits, expected)
    # The clone is independent: training it leaves megatrain's weights alone.
    before = paged.module.state_dict()["model.lm_head.weight"].clone()
    with torch.no_grad():
        clone.lm_head.weight.zero_()
    assert torch.equal(paged.module.state_dict()["model.lm_head.weight"], before)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_casting_the_model_after_fit_casts_it_for_real(tier, tmp_path, monkeypatch, capsys):
    """``model.to(torch.bfloat16)`` after training (for inference or ``save_pretrained``): the model leaves
    megatrain with real parameters, bitwise the default strategy's cast, ``.float()`` then the rounded
    weights (the disk tier's read into RAM with a progress bar, shown here for a tiny model's bytes); a move
    to where the parameters are changes nothing and leaves the model paged."""
    model = tiny_model("llama")
    plain = user_fit(model, "auto")
    kwargs = {"offload_dir": tmp_path / "store"} if tier == "disk" else {}
    paged = user_fit(model, MegaTrainStrategy(**kwargs))
    for run in (plain, paged):  # gradients of a backward of the user's, which a move or cast keeps
        run.module.zero_grad()
        run.module(token_batches(1, seed=3)[0]).loss.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "p.grad is a copy" warning: torch's `_apply` is not user code
        paged.module.model.to("cpu").float()
    assert isinstance(paged.module.model.lm_head.weight, ParamPlaceholder)
    assert torch.equal(paged.module.model.lm_head.weight.grad, plain.module.model.lm_head.weight.grad)
    monkeypatch.setattr("megatrain_lightning.telemetry.progress.SHOWN_FROM_BYTES", 1)
    capsys.readouterr()
    ids = token_batches(1)[0]
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.float()):
        expected, got = cast(plain.module.model), cast(paged.module.model)
        assert not any(isinstance(p, ParamPlaceholder) for p in got.parameters())
        for (name, a), b in zip(expected.state_dict().items(), got.state_dict().values(), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), name
        with torch.no_grad():
            assert torch.equal(expected(input_ids=ids).logits, got(input_ids=ids).logits)
    assert ("reading weights: 100%" in capsys.readouterr().err) == (tier == "disk")
    assert not (tmp_path / "store").exists()  # the folder made for the store went with it


class CastDuringTraining(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, *args: Any) -> None:
        pl_module.half()


def test_casting_the_model_while_megatrain_trains_it_is_an_error():
    """Refused in a first run and in a later run of the same module (whose engine lives on)."""
    with pytest.raises(RuntimeError, match="cannot be cast or moved .* while megatrain runs it"):
        user_fit(tiny_model("llama"), MegaTrainStrategy(), steps=1, callbacks=[CastDuringTraining()])
    run = user_fit(tiny_model("llama"), MegaTrainStrategy(), steps=1)
    loader = torch.utils.data.DataLoader(token_batches(1), batch_size=None)
    trainer = quiet_trainer(MegaTrainStrategy(), 2, [CastDuringTraining()])
    with pytest.raises(RuntimeError, match="cannot be cast or moved .* while megatrain runs it"):
        trainer.fit(run.module, train_dataloaders=loader)


def test_a_trained_model_pickles_whole_as_a_plain_model(tmp_path):
    """``torch.save(model)`` after fit: the unpickled model is a plain one with the trained weights."""
    paged = user_fit(tiny_model("llama"), MegaTrainStrategy())
    torch.save(paged.module.model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert not any(isinstance(p, ParamPlaceholder) for p in loaded.parameters())
    ids = token_batches(1)[0]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, paged.module.model(input_ids=ids).logits)


def test_deepcopy_keeps_tied_weights_tied():
    paged = user_fit(tiny_model("gpt2"), MegaTrainStrategy(), steps=1)
    clone = copy.deepcopy(paged.module.model)
    assert clone.lm_head.weight is clone.transformer.wte.weight


class GradNormLM(UserLM):
    """Logs gradient norms where Lightning's docs say to: ``on_before_optimizer_step``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.grad_norms: list[dict[str, float]] = []

    def on_before_optimizer_step(self, optimizer) -> None:
        self.grad_norms.append({k: float(v) for k, v in grad_norm(self, norm_type=2).items()})


@pytest.mark.parametrize("accumulate", [1, 2])
def test_grad_norms_in_on_before_optimizer_step_equal_plain(accumulate):
    model = tiny_model("llama")
    plain = user_fit(model, "auto", module_cls=GradNormLM, accumulate_grad_batches=accumulate)
    with pytest.warns(UserWarning, match="p.grad. is a copy"):
        paged = user_fit(
            model, MegaTrainStrategy(), module_cls=GradNormLM, accumulate_grad_batches=accumulate
        )
    assert_same_training(plain, paged)
    assert len(plain.module.grad_norms) == len(paged.module.grad_norms) > 0
    for expected, got in zip(plain.module.grad_norms, paged.module.grad_norms, strict=True):
        assert expected.keys() == got.keys()
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-6), key


class GradEditLM(UserLM):
    """User code that changes the gradients the ways users do (``edit`` says which); ``manual ...`` edits
    optimize manually, the others in Lightning's hooks."""

    edit = ""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.automatic_optimization = not self.edit.startswith("manual")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.automatic_optimization:
            return super().training_step(batch, batch_idx)
        opt = self.optimizers()
        loss = self(batch).loss
        self.manual_backward(loss)
        if self.edit == "manual clip_grad_norm_":
            torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)
        opt.step()
        if self.edit == "manual Module.zero_grad":
            self.zero_grad()
        elif self.edit == "manual Module.zero_grad(set_to_none=False)":
            self.zero_grad(set_to_none=False)
        elif self.edit != "manual no zero_grad":
            opt.zero_grad()
        return loss.detach()

    def on_after_backward(self) -> None:
        if self.edit == "p.grad assigned":  # e.g. gradient surgery; accumulating: the running sum is scaled
            for p in self.parameters():
                if p.grad is not None:
                    p.grad = p.grad * 0.5

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.edit == "clip_grad_norm_ in the hook":
            torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)
        elif self.edit == "clip_grad_value_ in the hook":
            torch.nn.utils.clip_grad_value_(self.parameters(), 1e-3)
        elif self.edit == "p.grad scaled in place":
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(0.25)
        elif self.edit == "p.grad.data clamped":  # the old idiom: `.data` has its own version counter
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.data.clamp_(-1e-3, 1e-3)
        elif self.edit == "p.grad set to None, clipped by norm":  # its norm was taken in the backward
            self.model.lm_head.weight.grad = None


GRAD_EDITS = [
    "manual clip_grad_norm_",
    "manual Module.zero_grad",
    "manual Module.zero_grad(set_to_none=False)",
    "p.grad assigned",
    "clip_grad_norm_ in the hook",
    "clip_grad_value_ in the hook",
    "p.grad scaled in place",
    "p.grad.data clamped",
    "p.grad set to None, clipped by norm",
]


@pytest.mark.parametrize("edit", GRAD_EDITS)
def test_gradients_user_code_changes_are_the_gradients_the_step_uses(edit):
    """``p.grad`` is a copy of the store's sum, one tensor while user code holds it: what user code does
    to it (torch's clipping, in-place scaling through it or its ``.data``, assignment, ``Module.zero_grad``)
    reaches the step and the trainer's clipping norm, bitwise the default strategy's, accumulating (hooks)
    or not (manual)."""
    module_cls = type("EditLM", (GradEditLM,), {"edit": edit})
    options: dict[str, Any] = {"accumulate_grad_batches": 1 if edit.startswith("manual") else 2}
    if "clipped by norm" in edit:
        options["gradient_clip_val"] = 0.05
    model = tiny_model("llama")
    plain = user_fit(model, "auto", module_cls=module_cls, **options)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "megatrain: `p.grad` is a copy")
        paged = user_fit(model, MegaTrainStrategy(), module_cls=module_cls, **options)
    assert_same_training(plain, paged)


class GradReadsLetGo(L.Callback):
    """Reads every gradient (a norm logger's pattern) and keeps only weak references to them."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        norms = [p.grad.norm() for p in pl_module.parameters() if p.grad is not None]
        self.refs += [weakref.ref(p.grad) for p in pl_module.parameters() if p.grad is not None]
        assert len(norms) == len(self.refs) > 0


def test_gradients_read_and_let_go_are_freed_not_gathered_on_the_device():
    """Reading every ``p.grad`` (logging norms) must not hold them all at once: the device never holds
    every gradient, as plain would; a copy lives as long as user code holds it."""
    reads = GradReadsLetGo()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "megatrain: `p.grad` is a copy")
        user_fit(tiny_model("llama"), MegaTrainStrategy(), steps=1, callbacks=[reads])
    assert reads.refs and all(ref() is None for ref in reads.refs)


def test_gradients_never_cleared_after_a_step_are_an_error_not_a_silent_difference():
    """Without ``zero_grad`` PyTorch adds the next backward to the last step's gradients, which megatrain
    dropped when its update used them: the next backward says what to call."""
    module_cls = type("EditLM", (GradEditLM,), {"edit": "manual no zero_grad"})
    with pytest.raises(RuntimeError, match="Call `optimizer.zero_grad..` .or `module.zero_grad..`. after"):
        user_fit(tiny_model("llama"), MegaTrainStrategy(), steps=2, module_cls=module_cls)


class FreezeFirstLayer(L.Callback):
    """Freezes one decoder layer from the third micro-batch on, and unfreezes another, after setup."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 2:
            pl_module.model.model.layers[0].requires_grad_(False)
            pl_module.model.model.layers[1].requires_grad_(True)


def test_requires_grad_changed_during_training_is_followed():
    model = tiny_model("llama")
    model.model.layers[1].requires_grad_(False)  # frozen at setup, unfrozen later
    plain = user_fit(model, "auto", steps=5, callbacks=[FreezeFirstLayer()])
    paged = user_fit(model, MegaTrainStrategy(), steps=5, callbacks=[FreezeFirstLayer()])
    assert_same_training(plain, paged)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_generate_with_its_cache_works_after_training(arch):
    model = tiny_model(arch)
    plain = user_fit(model, "auto")
    paged = user_fit(model, MegaTrainStrategy())
    prompt = token_batches(1, batch_size=1, seq_len=5)[0]
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    expected = plain.module.model.generate(prompt, **kwargs)
    assert torch.equal(paged.module.model.generate(prompt, **kwargs), expected)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_each_run_of_a_block_gets_a_cache_as_the_models(checkpointing):
    """A block that runs once gets the cache the plain model passes it; each run of a recomputed block an
    empty copy of it (a second run given the model's would append its keys again), so it computes as with
    the model's (whose `update` returns contiguous copies of the keys and values: GPT-2's attention
    dropout, CPM-Ant and Zamba2 round otherwise without one), and the model's cache stays empty, as under
    Hugging Face's own checkpointing."""
    given: list[tuple[Any, int]] = []
    returned: list[Any] = []

    def record(module, args, kwargs):
        cache = kwargs.get("cache")
        given.append((cache, cache.get_seq_length(module.layer_idx)))

    def keep(module, args, output):
        returned.append(output.past_key_values)

    model = tiny_model("llama")
    model.model.register_forward_hook(keep)
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(record, with_kwargs=True)
    runs = []
    for strategy in ("auto", MegaTrainStrategy(activation_checkpointing=checkpointing)):
        user_fit(model, strategy, steps=1)
        runs.append((given[:], returned[:]))
        given.clear()
        returned.clear()
    (plain_given, (plain_cache,)), (paged_given, (paged_cache,)) = runs
    layers = len(model.model.layers)
    assert [(c is plain_cache, n) for c, n in plain_given] == [(True, 0)] * layers
    assert plain_cache.get_seq_length() == 16
    if not checkpointing:
        assert [(c is paged_cache, n) for c, n in paged_given] == [(True, 0)] * layers
        assert paged_cache.get_seq_length() == 16
        return
    assert len({id(c) for c, _ in paged_given}) == 2 * layers  # a copy per run: forward and recompute
    assert all(type(c) is type(plain_cache) and c is not paged_cache and n == 0 for c, n in paged_given)
    assert paged_cache.get_seq_length() == 0


class EvalForwardTrainBackwardLM(UserLM):
    """A forward with gradients in ``eval()`` mode, ``train()`` set again before Lightning's backward."""

    def training_step(self, batch, batch_idx):
        self.model.eval()
        loss = super().training_step(batch, batch_idx)
        self.model.train()
        return loss


class MathAttentionLM(UserLM):
    def training_step(self, batch, batch_idx):
        with sdpa_kernel(SDPBackend.MATH):
            return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    "module_cls, dropout",
    [(EvalForwardTrainBackwardLM, 0.2), (MathAttentionLM, 0.0)],
    ids=["eval-mode", "sdpa-math"],
)
def test_the_recompute_runs_in_the_modes_and_kernels_the_forward_ran_in(module_cls, dropout):
    """Before, the recompute ran in the modes of the backward's time: dropout on (weights 1.2e-2 apart after
    two steps), the default attention kernel (1.3e-5)."""
    model = tiny_model("llama", attention_dropout=dropout)
    plain, paged = (user_fit(model, s, 2, module_cls=module_cls) for s in ("auto", MegaTrainStrategy()))
    assert_same_training(plain, paged)


class PromptThenContinuationLM(UserLM):
    """Prefix sharing: the prompt encoded once with its cache, the continuation attends over it."""

    grad_prompt = False

    def training_step(self, batch, batch_idx):
        with torch.set_grad_enabled(self.grad_prompt):
            cache = self.model(input_ids=batch[:, :8], use_cache=True).past_key_values
        logits = self.model(input_ids=batch[:, 8:], past_key_values=cache).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 9:].flatten())


class GradPromptThenContinuationLM(PromptThenContinuationLM):
    grad_prompt = True


class FirstLayerTwiceLM(UserLM):
    """The first decoder layer listed twice (layer sharing): its second run attends over the keys its first
    appended to the model's cache."""

    def training_step(self, batch, batch_idx):
        layers = self.model.model.layers
        self.model.model.layers = torch.nn.ModuleList([layers[0], *layers])
        try:
            return super().training_step(batch, batch_idx)
        finally:
            self.model.model.layers = layers


@pytest.mark.parametrize(
    "module_cls, checkpointing, refusal",
    [
        (PromptThenContinuationLM, False, None),
        (PromptThenContinuationLM, True, "a key/value cache holding 8 positions in a forward that computes"),
        (
            GradPromptThenContinuationLM,
            False,
            "whose keys and values an earlier forward computed with gradients",
        ),
        (GradPromptThenContinuationLM, True, "which `model.model.layers.0` had filled before"),
        (FirstLayerTwiceLM, False, "or an earlier run of the same layer in this forward"),
        (FirstLayerTwiceLM, True, "which `model.model.layers.0` had filled before in this forward"),
    ],
    ids=[
        "no-grad-prompt",
        "no-grad-prompt-checkpointed",
        "grad-prompt",
        "grad-prompt-checkpointed",
        "layer-twice",
        "layer-twice-checkpointed",
    ],
)
def test_a_continuation_attending_over_a_prompts_cache_trains_as_plain_or_is_refused(
    module_cls, checkpointing, refusal
):
    """Without activation checkpointing a block that runs once attends over the cache: bitwise. A recomputed
    block cannot (its second run would append again: the cache is dropped, which crashed inside attention);
    keys computed with gradients by an earlier call would lose theirs (silently before). Under the
    recompute, the cache a forward with gradients returned, and a layer run twice in one forward, attended
    over an empty copy (silently, until the refusal)."""
    model, strategy = tiny_model("llama"), MegaTrainStrategy(activation_checkpointing=checkpointing)
    if refusal is None:
        plain = user_fit(model, "auto", 2, module_cls=module_cls, seq_len=20)
        assert_same_training(plain, user_fit(model, strategy, 2, module_cls=module_cls, seq_len=20))
        return
    with pytest.raises((RuntimeError, MisconfigurationException), match=refusal):
        user_fit(model, strategy, 2, module_cls=module_cls, seq_len=20)


@pytest.mark.parametrize("reentrant", [False, True])
def test_hugging_face_checkpointing_is_taken_over_by_the_block_recompute(reentrant):
    """A user's ``gradient_checkpointing_enable()``: the default strategy's training bitwise, each layer run
    twice a step as under plain (not a recompute inside megatrain's), the user's checkpointing back after."""
    runs: list[int] = []
    model = tiny_model("llama")
    with pytest.warns(FutureWarning):  # transformers 5 renames it activation_checkpointing_enable
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda *_: runs.append(1))
    plain = user_fit(model, "auto", dicts=True)
    plain_runs, runs[:] = len(runs), []
    paged = user_fit(model, MegaTrainStrategy(), dicts=True)
    assert_same_training(plain, paged)
    assert len(runs) == plain_runs == 2 * 4
    layer = paged.module.model.model.layers[0]
    assert layer.gradient_checkpointing
    assert layer._gradient_checkpointing_func.keywords == {"use_reentrant": reentrant}


class RouterLossLM(UserLM):
    """A mixture of experts' load-balancing loss asked for per call: router logits from inside the layers."""

    def forward(self, batch: Any) -> Any:
        out = self.model(input_ids=batch, labels=batch, output_router_logits=True)
        assert out.aux_loss.requires_grad  # the loss the router logits feed is part of the loss trained
        return out


class AttentionEntropyLM(UserLM):
    """An auxiliary loss on the attention weights that each layer's attention hands to HF's collector."""

    def forward(self, batch: Any) -> Any:
        out = self.model(input_ids=batch, labels=batch, output_attentions=True)
        entropy = sum(-(a * a.clamp_min(1e-9).log()).sum(-1).mean() for a in out.attentions)
        out.loss = out.loss + 1e-2 * entropy
        return out


@pytest.mark.parametrize("checkpointing", [True, False])
@pytest.mark.parametrize(
    ("arch", "module_cls"), [("mixtral", RouterLossLM), ("llama", AttentionEntropyLM)], ids=["router", "attn"]
)
def test_outputs_collected_inside_the_layers_train_as_under_the_default_strategy(
    arch, module_cls, checkpointing
):
    """Router logits for the load-balancing loss, attention weights: HF's hooks collect them inside the
    layers; routed out through the block calls, their gradients reach the layers' weights bitwise as plain."""
    model = tiny_model(arch, attn_implementation="eager")
    plain = user_fit(model, "auto", steps=3, module_cls=module_cls)
    paged = user_fit(model, MegaTrainStrategy(activation_checkpointing=checkpointing), steps=3,
                     module_cls=module_cls)  # fmt: skip
    assert_same_training(plain, paged)


class MLPCaptureLM(UserLM):
    """A forward hook of the user's own keeps a tensor from inside a layer for an auxiliary loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.captured: list[torch.Tensor] = []
        model.model.layers[0].mlp.register_forward_hook(lambda m, i, out: self.captured.append(out))

    def forward(self, batch: Any) -> Any:
        self.captured.clear()
        out = self.model(input_ids=batch, labels=batch)
        out.loss = out.loss + self.captured[0].square().mean()
        return out


@pytest.mark.parametrize("checkpointing", [True, False])
def test_a_tensor_of_a_block_used_outside_its_outputs_is_a_clear_error(checkpointing):
    with pytest.raises(RuntimeError, match="used outside the block's outputs.*forward hook"):
        user_fit(tiny_model("llama"), MegaTrainStrategy(activation_checkpointing=checkpointing), steps=1,
                 module_cls=MLPCaptureLM)  # fmt: skip


def test_router_logits_are_refused_before_training_where_transformers_cannot_hand_them_over(monkeypatch):
    """Before transformers 5 the router logits stay out of reach inside the layers: refused before training."""
    monkeypatch.setattr("megatrain_lightning.user_code.routes_captures", lambda: False)
    with pytest.raises(
        MisconfigurationException, match="from transformers 5 on.*output_router_logits = False"
    ):
        user_fit(tiny_model("mixtral", output_router_logits=True), MegaTrainStrategy(), steps=1)


def test_weights_the_user_cast_to_bf16_are_trained_in_fp32_with_a_warning():
    with pytest.warns(UserWarning, match="keeps fp32 master weights.*torch.bfloat16"):
        run = user_fit(tiny_model("llama").to(torch.bfloat16), MegaTrainStrategy(), steps=1)
    assert all(p.dtype == torch.float32 for p in run.module.parameters())


class AliasingHead(torch.nn.Module):
    """Returns one of its own weights as an output (a view of the slot while the block runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(256))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.bias


class AliasingLM(ToyLM):
    def __init__(self) -> None:
        super().__init__()
        self.offset = AliasingHead()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> SimpleNamespace:
        out = super().forward(input_ids, labels=None)
        bias = self.offset(out.logits)  # a weight, returned; the next blocks reuse its slot
        for layer in self.layers:
            layer(torch.zeros(1, 1, 32))
        logits = out.logits + bias
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss, logits=logits)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_a_block_returning_its_own_weight_keeps_it_after_the_slot_is_reused(checkpointing):
    torch.manual_seed(0)
    model = AliasingLM()
    plain = user_fit(model, "auto")
    one_slot = MegaTrainStrategy(
        block_classes=[GradModeLayer], activation_checkpointing=checkpointing, max_vram_gb=3.4e-5
    )
    assert_same_training(plain, user_fit(model, one_slot))


def test_placeholders_in_lists_and_as_read_only_arguments_of_in_place_ops():
    run = user_fit(tiny_model("llama"), MegaTrainStrategy(), steps=1)
    params = list(run.module.model.model.norm.parameters()) + list(run.module.model.lm_head.parameters())
    stored = [p.detach().clone() for p in params]
    assert torch.equal(torch.cat([p.flatten() for p in params]), torch.cat([s.flatten() for s in stored]))
    with torch.no_grad():
        ema = [torch.zeros_like(s) for s in stored]
        torch._foreach_lerp_(ema, params, 0.5)  # what AveragedModel does: reads the weights
        ema[0].add_(params[0])
    assert torch.equal(ema[0], stored[0] * 1.5)
    snapshot = params[0].detach().to(torch.bfloat16)
    assert not isinstance(snapshot, ParamPlaceholder) and torch.equal(snapshot, stored[0].bfloat16())


class MixedPenaltyLM(UserLM):
    def training_step(self, batch, batch_idx):
        frozen, trainable = self.model.model.norm.weight, self.model.lm_head.weight
        return super().training_step(batch, batch_idx) + 1e-4 * torch.add(frozen.sum(), trainable.sum())


def test_a_penalty_on_frozen_and_trainable_weights_trains_as_plain():
    model = tiny_model("llama")
    model.model.norm.requires_grad_(False)
    plain, paged = (user_fit(model, s, module_cls=MixedPenaltyLM) for s in ("auto", MegaTrainStrategy()))
    assert_same_training(plain, paged)


class GradAtBatchEnd(L.Callback):
    def __init__(self) -> None:
        self.after_backward: list[float] = []

    def on_after_backward(self, trainer, pl_module) -> None:
        self.after_backward.append(float(pl_module.model.lm_head.weight.grad.norm()))


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_gradients_in_on_after_backward_equal_plain(tier, tmp_path):
    model = tiny_model("llama")
    plain_hook, paged_hook = GradAtBatchEnd(), GradAtBatchEnd()
    plain = user_fit(model, "auto", callbacks=[plain_hook])
    kwargs = {"offload_dir": tmp_path / "store", "max_cpu_gb": 0.01} if tier == "disk" else {}
    with pytest.warns(UserWarning, match="p.grad. is a copy"):
        paged = user_fit(model, MegaTrainStrategy(**kwargs), callbacks=[paged_hook])
    assert_same_training(plain, paged)
    assert paged_hook.after_backward == pytest.approx(plain_hook.after_backward, rel=1e-6)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_gradient_its_update_dropped_reads_none_not_zeros(tier, tmp_path):
    kwargs = {"offload_dir": tmp_path / "store", "max_cpu_gb": 0.01} if tier == "disk" else {}
    run = user_fit(tiny_model("llama"), MegaTrainStrategy(**kwargs))
    with pytest.warns(UserWarning, match="dropped once its update used it"):
        assert run.module.model.lm_head.weight.grad is None


def test_validation_between_steps_says_nothing_about_gradients():
    """Before each validation Lightning's ``on_validation_model_zero_grad`` reads every ``p.grad`` (to clear
    it); the user read none, so megatrain warns of no dropped or copied gradient (the README's first run
    validates every few steps)."""
    batches = token_batches(4)
    trainer = quiet_trainer(MegaTrainStrategy(), 4, [], val_check_interval=2, limit_val_batches=1)
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(UserLM(tiny_model("llama")), train_dataloaders=loader, val_dataloaders=loader)
    assert trainer.global_step == 4 and "val_loss" in trainer.callback_metrics
    assert [
        str(w.message) for w in caught if "grad" in str(w.message) and "megatrain" in str(w.message)
    ] == []


class TwiceBackwardLM(UserLM):
    """Lightning's ``backward`` hook overridden with two backwards through one forward."""

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        loss.backward(retain_graph=True)
        loss.backward()


def test_a_second_backward_through_one_forward_raises_instead_of_updating_early():
    """A block's update starts at its last backward of the pass; a backward after it would add to gradients
    already consumed: refused with a message, not a silently wrong step."""
    strategy = MegaTrainStrategy(activation_checkpointing=True)
    with pytest.raises(RuntimeError, match="second backward through one forward"):
        user_fit(tiny_model("llama"), strategy, module_cls=TwiceBackwardLM)


class TwoLossesOneForwardLM(UserLM):
    """Manual optimization with two backwards through one forward (``retain_graph=True``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        out = self(batch)
        self.manual_backward(out.loss, retain_graph=True)
        self.manual_backward(out.logits.float().pow(2).mean() * 1e-3)
        optimizer.step()
        optimizer.zero_grad()
        return out.loss.detach()


def test_two_backwards_through_one_forward_in_manual_optimization():
    model = tiny_model("llama")
    plain = user_fit(model, "auto", steps=2, module_cls=TwoLossesOneForwardLM)
    assert_same_training(
        plain, user_fit(model, MegaTrainStrategy(), steps=2, module_cls=TwoLossesOneForwardLM)
    )
    strategy = MegaTrainStrategy(activation_checkpointing=False)
    with pytest.raises(
        RuntimeError, match="second backward through .* needs .*activation_checkpointing=True"
    ):
        user_fit(model, strategy, steps=2, module_cls=TwoLossesOneForwardLM)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_forward_hooks_inside_a_block_run_again_in_the_recompute_as_the_readme_says(checkpointing):
    model = tiny_model("llama")
    calls = {"layer": 0, "mlp": 0}
    model.model.layers[0].register_forward_hook(lambda *_: calls.__setitem__("layer", calls["layer"] + 1))
    model.model.layers[0].mlp.register_forward_hook(lambda *_: calls.__setitem__("mlp", calls["mlp"] + 1))
    user_fit(model, MegaTrainStrategy(activation_checkpointing=checkpointing), steps=1)
    assert calls == {"layer": 1, "mlp": 2 if checkpointing else 1}


class GradientHookLM(UserLM):
    """A gradient hook on a layer's weight (masking its gradient), put on in `__init__` or `on_fit_start`."""

    def __init__(self, model: torch.nn.Module, when: str, kind: str) -> None:
        super().__init__(model)
        self.when, self.kind = when, kind
        if when == "init":
            self._hook()

    def on_fit_start(self) -> None:
        if self.when == "fit-start":
            self._hook()

    def _hook(self) -> None:
        weight = self.model.model.layers[1].mlp.down_proj.weight
        if self.kind == "tensor":
            weight.register_hook(lambda grad: grad * 0.0)
        else:
            weight.register_post_accumulate_grad_hook(lambda p: p.grad.zero_())


@pytest.mark.parametrize("kind", ["tensor", "post-accumulate"])
@pytest.mark.parametrize("when", ["init", "fit-start"])
def test_a_gradient_hook_on_a_weight_is_refused_not_skipped(when, kind):
    """The hook never ran (the layer's gradients are taken inside its paged call): a masked weight trained."""
    module = GradientHookLM(tiny_model("llama"), when, kind)
    trainer = quiet_trainer(MegaTrainStrategy(), 1, [])
    loader = torch.utils.data.DataLoader(token_batches(1), batch_size=None)
    with pytest.raises(
        MisconfigurationException, match="model.model.layers.1.mlp.down_proj.weight` has a gradient hook"
    ):
        trainer.fit(module, train_dataloaders=loader)
