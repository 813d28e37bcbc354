"""Hugging Face models in and out of the store without materializing them.

``from_pretrained(dir)`` under megatrain builds the model on meta and remembers where its
weights are; the engine then reads each tensor from its shard straight into its block's buffer
in the store (Hugging Face's own ``from_pretrained`` there loads as under the default strategy:
:func:`.meta.init_on_meta`). ``export_hf(ckpt_dir, out_dir)`` streams a megatrain checkpoint back out as
a ``save_pretrained`` directory. Both read and write safetensors only: nothing is unpickled.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import nn

from megatrain_lightning.serialization.initialization import loaded_from_files
from megatrain_lightning.serialization.meta import building_for_real, building_on_meta, init_on_meta
from megatrain_lightning.serialization.safetensors_io import (
    TensorEntry,
    read_header,
)

WEIGHTS_ATTR = "_megatrain_weights"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class WeightFiles:
    """The tensors of a safetensors checkpoint (one file or an indexed set of shards), by name."""

    directory: str
    entries: dict[str, TensorEntry]

    @classmethod
    def open(cls, directory: str) -> WeightFiles:
        index = os.path.join(directory, INDEX_NAME)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif os.path.exists(os.path.join(directory, SINGLE_NAME)):
            files = [SINGLE_NAME]
        else:
            raise MisconfigurationException(
                f"{directory} holds no safetensors weights ({SINGLE_NAME} or {INDEX_NAME}); save the model "
                "with `save_pretrained(..., safe_serialization=True)`."
            )
        entries: dict[str, TensorEntry] = {}
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.exists(path):
                raise MisconfigurationException(
                    f"{directory}: the shard {name} named by {INDEX_NAME} is missing."
                )
            entries.update(read_header(path))
        return cls(directory, entries)


def check_model_dir(directory: str) -> None:
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise MisconfigurationException(
            f"{directory!r} is not a Hugging Face model directory (no config.json)."
        )


def from_pretrained(directory: str, lazy: bool | None = None) -> nn.Module:
    """A causal LM from a local Hugging Face directory.

    Under megatrain (inside ``configure_model``), or with ``lazy=True``, the model is built on meta and
    the strategy fills its store from the shards block by block: peak memory stays near one block.
    Otherwise this is ``AutoModelForCausalLM.from_pretrained`` in fp32.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    check_model_dir(directory)
    weights = WeightFiles.open(directory)  # a missing or truncated shard fails here, before any work
    if not (building_on_meta() if lazy is None else lazy):
        with building_for_real():
            return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with init_on_meta():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.float32)
    setattr(model, WEIGHTS_ATTR, weights)
    loaded_from_files([p for name, p in model.named_parameters() if name in weights.entries])
    return model


def hf_model(module: nn.Module) -> tuple[str, Any] | None:
    """``(state-dict prefix, model)`` of the outermost Hugging Face model inside ``module``."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    for name, sub in module.named_modules():
        if isinstance(sub, PreTrainedModel):
            return (f"{name}." if name else ""), sub
    return None


def weight_sources(model: nn.Module) -> list[tuple[str, WeightFiles]]:
    """``(prefix, weights)`` for every submodule built by a lazy :func:`from_pretrained`."""
    return [
        (f"{name}." if name else "", getattr(module, WEIGHTS_ATTR))
        for name, module in model.named_modules()
        if hasattr(module, WEIGHTS_ATTR)
    ]


def find_entry(sources: list[tuple[str, WeightFiles]], aliases: list[str]) -> TensorEntry | None:
    """The stored tensor for a parameter known by ``aliases`` (tied weights have several names)."""
    for prefix, weights in sources:
        for name in aliases:
            if name.startswith(prefix) and name[len(prefix) :] in weights.entries:
                return weights.entries[name[len(prefix) :]]
    return None
