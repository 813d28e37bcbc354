"""Block discovery: Hugging Face `_no_split_modules`, the repeated layer list of any other model, or
the user's `block_classes`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import assert_same_training, user_fit
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.nn import functional as F
from zoo import tiny_zoo_config, tiny_zoo_model

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.engine.blocks import discover_blocks


class Expert(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Layer(nn.Module):
    """A residual layer with a nested list of two experts (a smaller repeated list)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + sum(expert(h) for expert in self.experts) / 2


class NormedEmbedding(nn.Module):
    """Owns a parameter and a submodule that owns more (as Inkling's embedding does)."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, dim))
        self.norm = nn.LayerNorm(dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(F.embedding(input_ids, self.weight))


class PlainLM(nn.Module):
    """A causal LM in plain PyTorch (no Hugging Face): its layers are an `nn.ModuleList`."""

    def __init__(self, vocab: int = 256, dim: int = 32, num_layers: int = 3) -> None:
        super().__init__()
        self.embed = NormedEmbedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim) for _ in range(num_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return SimpleNamespace(loss=loss, logits=logits)


class HandingOverLayer(Layer):
    """Leaves its normalized input on ``handed`` (an object, not a tensor argument), and adds what is there
    to its output: the next layer computes with the previous one's tensor, as layers that read keys and
    values another layer computed through the cache do."""

    def forward(self, x: torch.Tensor, handed: SimpleNamespace) -> torch.Tensor:
        h = self.norm(x)
        out = x + sum(expert(h) for expert in self.experts) / 2 + getattr(handed, "h", 0)
        handed.h = h
        return out


class HandingOverLM(PlainLM):
    def __init__(self, vocab: int = 256, dim: int = 32, num_layers: int = 3) -> None:
        super().__init__(vocab, dim, num_layers)
        self.layers = nn.ModuleList(HandingOverLayer(dim) for _ in range(num_layers))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        x, handed = self.embed(input_ids), SimpleNamespace()
        for layer in self.layers:
            x = layer(x, handed)
        logits = self.head(self.norm(x))
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return SimpleNamespace(loss=loss, logits=logits)


def _repeated(blocks) -> list[str]:
    return [block.name for block in blocks if block.repeated]


def test_the_repeated_layer_list_of_a_plain_pytorch_model_gives_the_blocks():
    blocks = discover_blocks(PlainLM())
    assert _repeated(blocks) == ["layers.0", "layers.1", "layers.2"]  # not the nested expert lists
    assert [b.name for b in blocks if not b.repeated] == ["embed", "norm", "head"]
    # one call site for the embedding: it binds its submodule's parameters too
    assert [site.name for site in blocks[0].sites] == ["embed"]
    assert [b.name for b in blocks[0].sites[0].bindings] == ["weight", "norm.weight", "norm.bias"]


def test_a_plain_pytorch_model_trains_like_plain_lightning():
    torch.manual_seed(0)
    model = PlainLM()
    plain = user_fit(model, "auto")
    paged = user_fit(model, MegaTrainStrategy())
    assert_same_training(plain, paged)
    assert _repeated(paged.trainer.strategy.engine.blocks) == [
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
    ]


@pytest.mark.parametrize(("arch", "layer"), [("biogpt", "layers"), ("openai-gpt", "h"), ("ctrl", "h")])
def test_hugging_face_models_without_no_split_modules_page_their_layers(arch, layer):
    model = tiny_zoo_model(arch)
    assert not model._no_split_modules
    prefix = f"{model.base_model_prefix}.{layer}"
    assert _repeated(discover_blocks(model)) == [f"{prefix}.0", f"{prefix}.1"]


def test_block_classes_override_the_repeated_layer_list():
    blocks = discover_blocks(PlainLM(num_layers=2), block_classes=[Expert])
    assert _repeated(blocks) == [f"layers.{i}.experts.{j}" for i in range(2) for j in range(2)]


def test_no_split_modules_naming_absent_classes_fall_back_to_the_layer_list():
    model = PlainLM(num_layers=2)
    model._no_split_modules = ["SomeOtherDecoderLayer"]
    assert _repeated(discover_blocks(model)) == ["layers.0", "layers.1"]


@pytest.mark.parametrize(
    "model",
    [
        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)),
        nn.ModuleList([nn.Linear(4, 4)]),  # one layer repeats nothing
        nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4)]),  # not one class
    ],
    ids=["no-list", "single-layer", "mixed-classes"],
)
def test_a_model_without_a_repeated_layer_list_names_block_classes(model):
    with pytest.raises(MisconfigurationException, match="block_classes=") as error:
        discover_blocks(model)
    assert "repeated layer list" in str(error.value)


def test_a_parameter_owner_inside_another_is_paged_by_the_outer_call():
    embed_block = discover_blocks(PlainLM())[0]
    assert [site.name for site in embed_block.sites] == ["embed"]
    assert {p.name for p in embed_block.params} == {"embed.weight", "embed.norm.weight", "embed.norm.bias"}


HANDED_OVER = "computes with a tensor that another block made and that is not one of its arguments"


def _handing_over_models() -> list:
    """Plain PyTorch, and Hugging Face models whose layers read keys and values another layer computed:
    Gemma 3n's last layers (``num_kv_shared_layers``) and, where transformers has it, Kolibri 1.1."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    gemma3n = tiny_zoo_config("gemma3n_text")
    gemma3n.num_kv_shared_layers = 1
    models = [
        pytest.param(HandingOverLM, id="plain"),
        pytest.param(lambda: AutoModelForCausalLM.from_config(gemma3n), id="gemma3n_text"),
    ]
    if "kolibri1_1" in CONFIG_MAPPING:
        models.append(pytest.param(lambda: tiny_zoo_model("kolibri1_1"), id="kolibri1_1"))
    return models


@pytest.mark.parametrize("checkpointed", [True, False])
@pytest.mark.parametrize("make_model", _handing_over_models())
def test_a_block_computing_with_another_blocks_tensor_is_refused_clearly(make_model, checkpointed):
    """Its gradient would be lost (backward routes block arguments and outputs only): refused on the first
    step. Under plain Lightning the same model trains."""
    torch.manual_seed(0)
    model = make_model()
    with pytest.raises(MisconfigurationException, match=HANDED_OVER):
        user_fit(model, MegaTrainStrategy(activation_checkpointing=checkpointed), steps=1)
    assert len(user_fit(model, "auto", steps=2).losses) == 2


@pytest.mark.parametrize("arch", ["hrm_text", "zaya"])
def test_a_model_whose_layer_container_owns_parameters_is_refused_clearly(arch):
    with pytest.raises(MisconfigurationException, match="owns parameters .* and also contains the blocks"):
        discover_blocks(tiny_zoo_model(arch))


def test_a_soft_prompt_on_the_lightning_module_itself_is_refused_with_the_fix():
    model = nn.Module()
    model.prompt = nn.Parameter(torch.zeros(4, 8))  # as a LightningModule holding a soft prompt
    model.llm = tiny_zoo_model("llama")
    with pytest.raises(MisconfigurationException, match=r"\['prompt'\].*Move them into a submodule"):
        discover_blocks(model)
