"""``bf16-mixed`` as Lightning's: bf16 slots only for the weights autocast casts anyway; embeddings and
one-dimensional parameters stay fp32 on the device (the residual stream stays fp32) and their
gradients leave it in fp32. On the CPU the training is then bitwise Lightning's ``bf16-mixed``."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import UserLM, assert_same_training, fit_module, tiny_model, token_batches, user_fit
from zoo import tiny_zoo_model

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.engine import runtime as engine_module
from megatrain_lightning.engine.blocks import discover_blocks
from megatrain_lightning.engine.grads import HostGrads
from megatrain_lightning.engine.slots import SlotLayout

STEPS = 4
ACCUMULATE = 2
MIXED = {"precision": "bf16-mixed", "accumulate_grad_batches": ACCUMULATE}


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(arch) -> torch.nn.Module:
    return tiny_model(arch)


@pytest.fixture(scope="module")
def plain(model):
    return user_fit(model, "auto", steps=STEPS, **MIXED)


def _bf16_names(model: torch.nn.Module) -> set[str]:
    """Weights that only a matmul autocast casts for reads: Linear and GPT-2's Conv1D weights (a head tied
    to the embedding goes by the embedding's name, fp32)."""
    return {f"{n}.weight" for n, m in model.named_modules() if type(m).__name__ in ("Linear", "Conv1D")}


def test_slot_dtypes_follow_autocast(model):
    """Linear (and Conv1D) weights in bf16; embeddings (tied with the head too), norms and biases in fp32.
    Without autocast every parameter has the compute dtype, laid out as the store's flat layout."""
    blocks = discover_blocks(copy.deepcopy(model))
    mixed, true = SlotLayout(blocks, torch.bfloat16, mixed=True), SlotLayout(blocks, torch.bfloat16)
    bf16 = _bf16_names(model)
    for block in blocks:
        for index, spec in enumerate(block.params):
            expected = torch.bfloat16 if spec.name in bf16 else torch.float32
            assert mixed.dtypes[block.index][index] == expected, spec.name
            assert true.dtypes[block.index][index] == torch.bfloat16
        assert [(r.start, r.end, r.offset) for r in true.runs[block.index]] == [(0, block.numel, 0)]
    assert bf16 and any(d == torch.bfloat16 for dtypes in mixed.dtypes for d in dtypes)


def test_slot_views_hold_each_parameter_in_its_dtype(model):
    """Copied into a slot, every parameter reads back its master weights rounded to its slot dtype."""
    blocks = discover_blocks(copy.deepcopy(model))
    layout = SlotLayout(blocks, torch.bfloat16, mixed=True)
    slot = torch.full((layout.nbytes,), 255, dtype=torch.uint8)
    for block in blocks:
        master = torch.randn(block.numel)
        layout.copy_in(block.index, master, slot)
        for index, view in enumerate(block.views(master)):
            got = layout.view(block.index, index, slot)
            assert got.dtype == layout.dtypes[block.index][index]
            assert torch.equal(got, view.to(got.dtype)), block.params[index].name


@pytest.mark.parametrize(
    "variant",
    ["default", "two_slots_no_checkpointing", "offload_thread"],
)
def test_bf16_mixed_trains_bitwise_like_lightnings(model, plain, arch, variant, monkeypatch):
    """Losses and weights equal Lightning's ``bf16-mixed`` (before, with every slot weight in bf16, the
    losses differed by ~1e-3 and the weights by ~3e-2 after 4 steps); the embedding's output, the
    residual stream, is fp32; norm, bias and embedding gradients leave the device in fp32."""
    kwargs = {}
    if variant == "two_slots_no_checkpointing":  # paged, the saved graph replayed on mixed-dtype slots
        blocks = discover_blocks(copy.deepcopy(model))
        slot = SlotLayout(blocks, torch.bfloat16, mixed=True).nbytes
        kwargs = {"max_vram_gb": 2 * slot / 1e9, "activation_checkpointing": False, "zero_copy": False}
    if variant == "offload_thread":  # the CUDA path's staging buffers, with fp32 and bf16 gradients
        monkeypatch.setattr(engine_module, "HostGrads", functools.partial(HostGrads, asynchronous=True))
    grad_dtypes: dict[str, set[torch.dtype]] = {}
    offload = HostGrads.offload

    def recorded(self, block, grads, *args, **kwargs):
        for index, grad in grads.items():
            grad_dtypes.setdefault(self.store.blocks[block].params[index].name, set()).add(grad.dtype)
        return offload(self, block, grads, *args, **kwargs)

    monkeypatch.setattr(HostGrads, "offload", recorded)
    embedded: list[torch.dtype] = []
    module = copy.deepcopy(model)
    embedding = module.get_input_embeddings()
    embedding.register_forward_hook(lambda m, args, out: embedded.append(out.dtype))
    run = user_fit(module, MegaTrainStrategy(**kwargs), steps=STEPS, **MIXED)
    if variant == "two_slots_no_checkpointing":  # the two largest blocks' budget: fewer slots than blocks
        engine = run.trainer.strategy.engine
        assert 2 <= engine.pager.num_slots < len(engine.blocks)
    else:  # on the CPU the blocks compute on the store's bf16 shadow and fp32 weights: nothing copied
        assert run.trainer.strategy.stats.h2d_bytes == run.trainer.strategy.stats.peak_slot_bytes == 0
    assert_same_training(plain, run)
    assert embedded and set(embedded) == {torch.float32}
    bf16 = _bf16_names(model)
    for qualified, dtypes in grad_dtypes.items():
        name = qualified.removeprefix("model.")  # the user's module holds the model as ``model``
        assert dtypes == {torch.bfloat16 if name in bf16 else torch.float32}, name


def test_a_second_fit_in_another_precision_lays_the_slots_out_anew(model):
    """The same module fitted in ``32-true``, then in ``bf16-mixed`` (the engine is reconfigured: new
    slots, new layout), trains as the default strategy does."""
    runs = []
    for megatrain in (False, True):
        module = UserLM(copy.deepcopy(model))
        first = fit_module(module, MegaTrainStrategy() if megatrain else "auto", steps=2)
        second = fit_module(
            module, MegaTrainStrategy() if megatrain else "auto", steps=2, precision="bf16-mixed"
        )
        runs.append((first, second))
    (plain_first, plain_second), (first, second) = runs
    assert second.trainer.strategy.engine.pager.layout.compute_dtype == torch.bfloat16
    assert_same_training(plain_first, first)
    assert_same_training(plain_second, second)


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "gpt_oss", "mamba", "cpmant"])
def test_zoo_bf16_mixed_is_lightnings(arch):
    """Expert weights fed to grouped matmuls or upcast by the model, state-space parameters, and others
    read in models' own ways stay fp32 as Lightning's (bf16 slots for them differed by up to 0.4 in loss;
    by hand, 137 of the zoo's 141 architectures train bitwise Lightning's bf16-mixed, see the report)."""
    model = tiny_zoo_model(arch)
    plain = user_fit(model, "auto", steps=2, precision="bf16-mixed")
    assert_same_training(plain, user_fit(model, MegaTrainStrategy(), steps=2, precision="bf16-mixed"))


def test_a_block_input_read_by_several_matmuls_sums_their_gradients_in_fp32():
    """OLMo-2 feeds a layer's fp32 input straight to q, k and v (post-norm): autocast must cast it anew at
    each use, as it does the previous layer's output under plain PyTorch, so the three input gradients
    are summed in fp32 (a cast shared through autocast's cache summed them in bf16: ~6e-3 weight
    differences after one step)."""
    model = tiny_zoo_model("olmo2")
    plain = user_fit(model, "auto", steps=2, precision="bf16-mixed")
    assert_same_training(plain, user_fit(model, MegaTrainStrategy(), steps=2, precision="bf16-mixed"))


class OutsideAutocastLM(UserLM):
    """User code that calls the model outside autocast under ``bf16-mixed``: an fp32 head for the loss
    (``autocast(enabled=False)``) and greedy generation at each epoch's end (Lightning runs its hooks
    outside autocast). The default strategy computes both in fp32 on its fp32 weights."""

    def training_step(self, batch, batch_idx):
        hidden = self.model.base_model(input_ids=batch).last_hidden_state
        with torch.autocast("cpu", enabled=False):
            logits = self.model.get_output_embeddings()(hidden.float())
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())

    def on_train_epoch_end(self) -> None:
        prompt = torch.tensor([[1, 2, 3, 4]])
        self.generated = self.model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False, pad_token_id=0
        )


def test_calls_outside_autocast_compute_in_fp32_as_lightnings(model):
    """Before, the slots' bf16 weights met fp32 inputs there: a dtype error in the head, in `generate`, and
    in a forward after `fit`. Now bitwise the default strategy's, the head's gradient included."""
    plain = user_fit(model, "auto", steps=STEPS, module_cls=OutsideAutocastLM, **MIXED)
    with pytest.warns(UserWarning, match="outside autocast.*computes in fp32"):
        paged = user_fit(model, MegaTrainStrategy(), steps=STEPS, module_cls=OutsideAutocastLM, **MIXED)
    assert_same_training(plain, paged)
    assert torch.equal(paged.module.generated, plain.module.generated)
    prompt = torch.tensor([[5, 6, 7]])
    with torch.no_grad():  # after `fit`, the trainer kept
        assert torch.equal(
            paged.module.model(input_ids=prompt).logits, plain.module.model(input_ids=prompt).logits
        )


def test_bf16_true_computes_in_bf16_from_fp32_master_weights(arch):
    """Not Lightning's ``bf16-true``, which steps bf16 weights with AdamW in bf16: the recipe of training with
    master weights, bitwise (each step a bf16 copy of the fp32 masters computes; its gradients, widened,
    step the masters by an fp32 AdamW). ``state_dict`` holds the fp32 masters. (A tied weight's uses are
    summed in fp32, where the bf16 copy sums them in bf16: within a rounding, so untied here.)"""
    model = tiny_model(arch, tie_word_embeddings=False)
    paged = user_fit(model, MegaTrainStrategy(), steps=STEPS, precision="bf16-true")
    master = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(master.parameters(), lr=UserLM(master).lr)
    losses = []
    for batch in token_batches(STEPS):
        compute = copy.deepcopy(master).to(torch.bfloat16)
        loss = compute(input_ids=batch, labels=batch).loss
        loss.backward()
        losses.append(float(loss))
        for weight, bf16 in zip(master.parameters(), compute.parameters(), strict=True):
            weight.grad = bf16.grad.float()
        optimizer.step()
        optimizer.zero_grad()
    assert paged.losses == losses
    trained, expected = paged.module.model.state_dict(), master.state_dict()
    assert all(trained[k].dtype == torch.float32 and torch.equal(trained[k], expected[k]) for k in expected)
