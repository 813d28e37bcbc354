"""Partition a model into blocks: the units whose parameters page together.

A block is either one instance of a *block class* (for Hugging Face models the classes in
``_no_split_modules``, e.g. ``LlamaDecoderLayer``; for other models the class of the repeated
layer list) or, for parameters outside every such instance, the modules that own them directly
(embeddings, final norm, head). Modules that
share a parameter (GPT-2's tied ``wte``/``lm_head``) are merged into one block, so every
parameter is stored exactly once.

A *call site* is a module whose forward runs with its block resident; a block has one call
site per module that reaches its parameters (two for a tied embedding/head block).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn

from megatrain_lightning.store.layout import SMALL_PARAM, Block, ParamSpec, align_up


@dataclass(frozen=True)
class Binding:
    """``owner.<attr>`` must read block parameter ``index`` while the call site runs; ``name`` is the
    parameter's name relative to the call site's module (its ``state_dict`` key there)."""

    owner: nn.Module
    attr: str
    index: int
    name: str


@dataclass(eq=False)
class CallSite:
    module: nn.Module
    name: str
    block: Block
    bindings: list[Binding]
    graph_checked: bool = False  # a call's graph was searched once for other blocks' tensors (paged_call)
    caches: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # the key/value caches its calls got

    @property
    def param_indices(self) -> list[int]:
        """Block parameters this call site reaches, each once, in first-seen order."""
        return list(dict.fromkeys(b.index for b in self.bindings))


def _repeated_layer_class(model: nn.Module) -> str | None:
    """The class of the model's repeated layers: the children of the ``nn.ModuleList`` of two or more
    modules of one class that holds the most parameters (nested lists, e.g. experts, hold fewer)."""
    best, best_numel = None, 0
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        classes = {type(child) for child in module}
        numel = sum(p.numel() for p in module.parameters())
        if len(classes) == 1 and numel > best_numel:
            best, best_numel = classes.pop().__name__, numel
    return best


def _class_names(block_classes: Iterable[str | type] | None, model: nn.Module) -> set[str]:
    """``block_classes`` if given, else the Hugging Face ``_no_split_modules`` that the model contains,
    else the repeated layer class."""
    if block_classes:
        return {c if isinstance(c, str) else c.__name__ for c in block_classes}
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    if names & {type(module).__name__ for module in model.modules()}:
        return names
    repeated = _repeated_layer_class(model)
    return {repeated} if repeated else set()


def discover_blocks(model: nn.Module, block_classes: Iterable[str | type] | None = None) -> list[Block]:
    """Split ``model``'s parameters into blocks; raise a clear error where that is impossible."""
    class_names = _class_names(block_classes, model)
    if not class_names:
        raise MisconfigurationException(
            f"Cannot find the blocks of {type(model).__name__}: it names no `_no_split_modules` and has no "
            "repeated layer list (an `nn.ModuleList` of two or more layers of one class). Pass the layer "
            "classes, e.g. `MegaTrainStrategy(block_classes=['LlamaDecoderLayer'])`."
        )
    block_roots: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if type(module).__name__ in class_names and not any(name.startswith(r + ".") for r in block_roots):
            block_roots[name] = module
    if not block_roots:
        raise MisconfigurationException(
            f"No module of {type(model).__name__} is an instance of the block classes {sorted(class_names)}. "
            "Check `block_classes`: it takes class names or classes of the repeated layers."
        )

    def in_block(name: str) -> bool:
        return any(name == r or name.startswith(r + ".") for r in block_roots)

    # Modules outside every block that own parameters directly each become a call site, unless an
    # enclosing one does: its call site already binds their parameters, and a call site nested in
    # another of the same block would release the block while the outer one still uses it.
    owners: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if (
            not in_block(name)
            and not any(name.startswith(owner + ".") for owner in owners)
            and module._parameters
            and any(p is not None for p in module._parameters.values())
        ):
            owners.setdefault(name, module)
    for name in owners:
        nested = [r for r in block_roots if name == "" or r.startswith(name + ".")]
        if nested:
            own = [n for n, p in owners[name]._parameters.items() if p is not None]
            fix = (
                "Move them into a submodule whose forward computes with them (or returns them: a soft "
                "prompt as an `nn.Embedding`, or a small `nn.Module`), and call it where they are used."
                if name == ""
                else "Name it in `block_classes` (it is then paged as one block) or move them into a "
                "submodule whose forward computes with them."
            )
            raise MisconfigurationException(
                f"megatrain: module `{name or type(model).__name__}` owns parameters ({own[:3]}) and also "
                f"contains the blocks {nested[:2]}...: megatrain pages parameters with the module call "
                f"that uses them, and this module's call would hold every block at once. {fix}"
            )

    order = {name: i for i, (name, _) in enumerate(model.named_modules(remove_duplicate=False))}
    sites = dict(sorted({**block_roots, **owners}.items(), key=lambda item: order[item[0]]))
    # Merge call sites that share a parameter (tied weights) with a small union-find.
    parent = {name: name for name in sites}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    first_site: dict[int, str] = {}
    site_params: dict[str, list[tuple[nn.Module, str, str, nn.Parameter]]] = {}
    for site_name, module in sites.items():
        entries = []
        for sub_name, sub in module.named_modules(remove_duplicate=False):
            for attr, param in sub._parameters.items():
                if param is None:
                    continue
                entries.append((sub, attr, f"{sub_name}.{attr}" if sub_name else attr, param))
                other = first_site.setdefault(id(param), site_name)
                parent[find(site_name)] = find(other)
        site_params[site_name] = entries

    groups: dict[str, list[str]] = {}
    for site_name in sites:
        groups.setdefault(find(site_name), []).append(site_name)

    qualified = {id(p): n for n, p in model.named_parameters()}
    blocks: list[Block] = []
    for members in groups.values():
        unique = {id(p): p for site_name in members for *_, p in site_params[site_name]}
        layout = sorted(unique.values(), key=lambda p: p.numel() < SMALL_PARAM)  # stable: large first
        block = Block(
            index=len(blocks), name=" + ".join(members), repeated=all(m in block_roots for m in members)
        )
        position: dict[int, int] = {}
        offset = 0
        for param in layout:
            if param.numel() < SMALL_PARAM and not block.large_numel:
                block.large_numel = offset
            position[id(param)] = len(block.params)
            name = qualified[id(param)]
            block.params.append(ParamSpec(name, param.shape, offset, param.numel(), param.requires_grad))
            offset = align_up(offset + param.numel())
        block.numel = offset
        block.large_numel = block.large_numel or offset
        for site_name in members:
            bindings = [Binding(o, a, position[id(p)], rel) for o, a, rel, p in site_params[site_name]]
            block.sites.append(CallSite(sites[site_name], site_name, block, bindings))
        blocks.append(block)
    return blocks


def bind(block: Block, tensors: Sequence[Tensor]) -> None:
    """Make ``tensors[i]`` parameter ``i`` of ``block`` in every module that holds it (tied aliases too)."""
    for site in block.sites:
        for binding in site.bindings:
            binding.owner._parameters[binding.attr] = tensors[binding.index]
