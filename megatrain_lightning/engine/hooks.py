"""What the engine changes on a model, installed and removed as pairs.

Each call site's ``forward`` becomes a :class:`PagedForward` and its ``state_dict``/``load_state_dict``
read and write the store through :class:`EngineHook` objects registered with torch's public hook
APIs. All of them reach the store through the module's :class:`~.weights.StoredWeights`, never the
engine itself. :func:`install` returns the undo of every change, so ``StoredWeights.uninstall_hooks``
gives the modules back their own behaviour. A deep copy of a module (an EMA copy, with materialized
weights) gets its own forward back and inert hooks: nothing in it reaches the engine.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from megatrain_lightning.engine.blocks import CallSite
from megatrain_lightning.engine.placeholders import ParamPlaceholder, converting, converting_modules

if TYPE_CHECKING:
    from megatrain_lightning.engine.weights import StoredWeights


def install(weights: StoredWeights) -> list[Callable[[], None]]:
    """Page every call site of ``weights``' blocks; returns the undo of each change, in order."""
    undo: list[Callable[[], None]] = []
    for block in weights.blocks:
        for site in block.sites:
            module = site.module
            own_forward = module.__dict__.get("forward")
            module.forward = PagedForward(weights, site, module.forward)
            undo.append(functools.partial(_restore, module, "forward", own_forward))
            handles = [
                module.register_state_dict_post_hook(
                    EngineHook(functools.partial(weights.state_dict_hook, site))
                ),
                module.register_load_state_dict_pre_hook(
                    EngineHook(functools.partial(weights.load_hook, site))
                ),
                module.register_load_state_dict_post_hook(EngineHook(weights.forget_loaded_keys)),
            ]
            undo.extend(handle.remove for handle in handles)
    owners = {id(b.owner): b.owner for block in weights.blocks for site in block.sites for b in site.bindings}
    for owner in owners.values():
        own_apply = owner.__dict__.get("_apply")
        owner._apply = PagedApply(weights, owner, owner._apply)
        undo.append(functools.partial(_restore, owner, "_apply", own_apply))
    return undo


class _StandIn:
    """A method of a module the engine stands in for (``own``: the module's). A deep copy of the module
    (whose parameters the copy materializes) or a pickled one (``torch.save(model)``) gets its own back."""

    own: Callable

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable:
        return copy.deepcopy(self.own, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.own.__reduce_ex__(protocol)


class PagedForward(_StandIn):
    """A call site's ``forward`` while the store holds its weights."""

    def __init__(self, weights: StoredWeights, site: CallSite, forward: Callable) -> None:
        self.weights, self.site, self.own = weights, site, forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.weights.forward(self.site, self.own, *args, **kwargs)


class PagedApply(_StandIn):
    """A parameter owner's ``_apply`` (``module.to``, ``.half()``, ``.cuda()``). A cast or move of its
    placeholders outside the strategy's own conversion takes the model out of megatrain first
    (:meth:`StoredWeights.release`), so that the weights are cast or moved for real, as a plain model's
    are; a call that changes nothing (a move to where the parameters are) leaves it paged."""

    def __init__(self, weights: StoredWeights, owner: nn.Module, apply: Callable) -> None:
        self.weights, self.owner, self.own = weights, owner, apply

    def __call__(self, fn: Callable, recurse: bool = True) -> nn.Module:
        if not converting() and self._changes(fn):
            self.weights.release()
        return self.own(fn, recurse)

    def _changes(self, fn: Callable) -> bool:
        """Whether ``fn`` casts or moves the owner's placeholders (all alike: one is asked)."""
        param = next((p for p in self.owner._parameters.values() if isinstance(p, ParamPlaceholder)), None)
        if param is None:
            return False
        try:
            with converting_modules():  # what it would report, nothing read
                applied = fn(param)
        except Exception:  # an in-place change (`share_memory_`) or a function only real tensors take
            return True
        return applied.dtype != param.dtype or applied.device != param.device


class EngineHook:
    """A state-dict hook that reads or writes the store; inert in a deep copy of the module."""

    def __init__(self, function: Callable) -> None:
        # Not named `hook`: torch's `_WrappedHook` copies this object's attributes onto itself.
        self.function = function

    def __call__(self, *args: Any) -> None:
        self.function(*args)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable:
        return _nothing_with

    def __reduce_ex__(self, protocol: Any) -> tuple[Callable, tuple]:
        return _inert, ()  # pickled (``torch.save(model)``): unpickled as a hook that does nothing


def _inert() -> Callable:
    return _nothing_with


def _nothing_with(*args: Any) -> None:
    return None


def _restore(module: nn.Module, name: str, own: Callable | None) -> None:
    """Give ``module`` back its own ``name`` (an instance attribute it had, or its class's)."""
    if own is None:
        module.__dict__.pop(name, None)
    else:
        setattr(module, name, own)
