"""Taking a model over: each block's weights go into the store (read from the shards a lazy
``from_pretrained`` named, copied from real parameters, or initialized there as the plain build would
have drawn them), and the module is left holding placeholders."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from megatrain_lightning.engine.blocks import bind
from megatrain_lightning.engine.placeholders import ParamPlaceholder
from megatrain_lightning.serialization.hf import find_entry, hf_model, weight_sources
from megatrain_lightning.serialization.initialization import initialize
from megatrain_lightning.serialization.safetensors_io import read_into
from megatrain_lightning.store.layout import Block
from megatrain_lightning.telemetry.progress import byte_progress

if TYPE_CHECKING:
    from megatrain_lightning.engine.runtime import Engine

log = logging.getLogger(__name__)


def adopt(engine: Engine, model: nn.Module) -> None:
    """Move each of ``engine``'s blocks' weights into its store (or initialize them there) and leave
    placeholders in ``model``."""
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    found = hf_model(model)
    init_hf = found[1]._init_weights if found is not None else None
    sources = weight_sources(model)
    missing = []
    progress = byte_progress(4 * sum(b.numel for b in engine.blocks), "loading weights into the store")
    for block in engine.blocks:
        originals = [_current_param(block, i) for i in range(len(block.params))]
        for index, original in enumerate(originals):
            for name in aliases[id(original)]:
                engine.locations[name] = (block.index, index)
        stored = [find_entry(sources, aliases[id(p)]) if p.is_meta else None for p in originals]
        unfilled = [
            s.name for s, p, e in zip(block.params, originals, stored, strict=True) if p.is_meta and not e
        ]
        missing += unfilled
        with engine.store.rewriting(block.index) as flat:
            views = block.views(flat)
            if unfilled:
                _initialize(block, views, init_hf)
            for view, original, entry in zip(views, originals, stored, strict=True):
                if entry is not None:
                    read_into(entry, view)
                elif not original.is_meta:
                    view.copy_(original.detach())
        placeholders = [
            ParamPlaceholder.make_parameter(
                engine.weights,
                block.index,
                index,
                spec.name,
                shape=spec.shape,
                dtype=torch.float32,
                device=engine.config.device,
                requires_grad=spec.requires_grad,
            )
            for index, spec in enumerate(block.params)
        ]
        engine.weights.placeholders.append(placeholders)
        bind(block, placeholders)
        progress.update(4 * block.numel)
    progress.close()
    if sources and missing:
        log.warning(
            f"megatrain: {len(missing)} parameters are not in the checkpoint; initialized: {missing[:5]}"
        )


def _current_param(block: Block, spec_index: int) -> nn.Parameter:
    for site in block.sites:
        for binding in site.bindings:
            if binding.index == spec_index:
                return binding.owner._parameters[binding.attr]
    raise AssertionError("every block parameter has a binding")


def _initialize(block: Block, views: list[Tensor], init_hf: Callable[[nn.Module], None] | None) -> None:
    """Initialize a block built on meta directly in the store, as recorded when it was built (the plain
    build's values) or else the way its model would."""
    params = [nn.Parameter(v, requires_grad=False) for v in views]
    bind(block, params)
    with torch.no_grad():
        for site in block.sites:
            for module in site.module.modules():
                initialize(module, init_hf)
