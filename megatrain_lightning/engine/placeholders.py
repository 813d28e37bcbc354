"""What a module's parameters are between block calls: placeholders that know where the weights are.

Under megatrain a parameter's numbers live in the store and visit the device only while its block
runs. Outside its block the module holds a :class:`ParamPlaceholder` in its place: a tensor without
storage that reports the shape, the compute device and the dtype the default strategy would show
(Llama-4 moves its inputs to ``embed_tokens.weight.device``; ``model.dtype`` picks mask values), and
keeps the user's ``requires_grad`` flag (unfreezing callbacks set it). Reading its *values* (a
weight-norm callback, ``copy.deepcopy`` for an EMA copy) gives a copy read from the store; where that
would silently lose a gradient (inside ``training_step`` with autograd on) or change the weights
behind the store's back (in-place ops), it raises an error that names megatrain and the parameter.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map


class WeightSource(Protocol):
    """What a placeholder asks about its weights (:class:`~.weights.StoredWeights` answers)."""

    guard_training_reads: bool

    def read_param(self, block: int, index: int) -> Tensor: ...

    def user_grad(
        self, block: int, index: int, device: torch.device, dtype: torch.dtype
    ) -> Tensor | None: ...

    def assign_grad(self, block: int, index: int, value: Tensor | None) -> None: ...


class ParamPlaceholder(Tensor):
    """Stands for parameter ``index`` of ``block`` in the engine's store (see the module docstring)."""

    _source: WeightSource
    _block: int
    _index: int
    _name: str

    @staticmethod
    def __new__(
        cls,
        source: WeightSource,
        block: int,
        index: int,
        name: str,
        shape: torch.Size,
        dtype: torch.dtype,
        device: torch.device,
        requires_grad: bool = False,
    ) -> ParamPlaceholder:
        t = Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=requires_grad)
        t._source, t._block, t._index, t._name = source, block, index, name
        return t

    @classmethod
    def make_parameter(
        cls, source: WeightSource, block: int, index: int, name: str, **meta: Any
    ) -> nn.Parameter:
        """A placeholder that ``isinstance(..., nn.Parameter)`` accepts, as modules hold them."""
        requires_grad = meta.pop("requires_grad", True)
        return nn.Parameter(cls(source, block, index, name, **meta), requires_grad=requires_grad)

    def _like(self, dtype: torch.dtype | None = None, device: torch.device | None = None) -> ParamPlaceholder:
        return ParamPlaceholder(
            self._source,
            self._block,
            self._index,
            self._name,
            self.shape,
            dtype or self.dtype,
            device or self.device,
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (
            f"megatrain parameter {self._name} (shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}; weights in the store)"
        )

    def materialize(self) -> Tensor:
        """A copy of the current weights, in this placeholder's dtype and on its device."""
        return self._source.read_param(self._block, self._index).to(self.device, self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, ParamPlaceholder):
            if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
                return first._like()  # `p.data`, `p.detach()`: still a placeholder
            if (
                func is torch.ops.aten._to_copy.default
                and _converting.active
                and set(kwargs) <= _METADATA_ONLY
            ):
                # The strategy's `module.to(dtype)` (bf16-true): what it reports changes, not the store.
                return first._like(kwargs.get("dtype"), kwargs.get("device"))
        written = _written_arguments(func, args, kwargs)
        for placeholder in tree_flatten((args, kwargs))[0]:
            if isinstance(placeholder, ParamPlaceholder):
                placeholder._check_use(func, changed=any(placeholder is w for w in written))
        return func(*tree_map(_materialized, args), **tree_map(_materialized, kwargs))

    def _check_use(self, func: Any, changed: bool) -> None:
        """Refuse what would change the store behind its back or lose a gradient."""
        if changed:
            raise RuntimeError(
                f"megatrain: `{self._name}` cannot be changed in place ({func}): its weights live in "
                "megatrain's store. Use `module.load_state_dict(...)` to set weights."
            )
        if self._source.guard_training_reads and torch.is_grad_enabled() and self.requires_grad:
            raise RuntimeError(
                f"megatrain: `{self._name}` was read outside the block that owns it during `training_step` "
                f"({func}); its gradient would be lost. Read parameters only inside their own module's "
                "forward, or name the module that reads it in `MegaTrainStrategy(block_classes=...)`."
            )

    @property
    def grad(self) -> Tensor | None:  # type: ignore[override]
        """A copy of the gradient summed in the store (warned once), the same tensor while user code holds
        it; what user code changes in it is written back (:mod:`.user_grads`). ``None`` when there is none.
        ``Module.zero_grad`` (which Lightning calls before each validation) reads it without a warning: it
        only looks whether there is one to clear."""
        quiet = sys._getframe(1).f_code is _ZERO_GRAD
        with warnings.catch_warnings() if quiet else contextlib.nullcontext():
            if quiet:
                warnings.simplefilter("ignore")
            grad = self._source.user_grad(self._block, self._index, self.device, self.dtype)
        if quiet and grad is None:  # `Module.zero_grad` clears what is there: a sum its update used, too
            self._source.assign_grad(self._block, self._index, None)
        if grad is not None and not quiet:
            _warn_grad_copy()
        return grad

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        if value is not None and value.shape != self.shape:
            raise RuntimeError(
                f"megatrain: `{self._name}.grad` assigned a tensor of shape {tuple(value.shape)}; the "
                f"parameter's shape is {tuple(self.shape)}."
            )
        self._source.assign_grad(self._block, self._index, value)

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Parameter:
        """A real parameter holding a copy of the weights (an EMA copy of the model is a plain model)."""
        return nn.Parameter(self.materialize(), requires_grad=self.requires_grad)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (_rebuild_parameter, (self.materialize(), self.requires_grad))


_METADATA_ONLY = {"dtype", "device", "layout", "non_blocking", "memory_format"}
_ZERO_GRAD = nn.Module.zero_grad.__code__


class _Converting(threading.local):
    active = False


_converting = _Converting()


def converting() -> bool:
    """Whether the strategy converts modules now (:func:`converting_modules`)."""
    return _converting.active


@contextlib.contextmanager
def converting_modules() -> Iterator[None]:
    """Within, ``module.to(dtype)`` changes the dtype placeholders report (the strategy converting a
    module for ``bf16-true``); elsewhere ``p.to(...)`` gives a copy of the weights, as for any tensor."""
    _converting.active = True
    try:
        yield
    finally:
        _converting.active = False


def _written_arguments(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments ``func`` writes to (``self`` of an in-place op, ``out=``), by its schema."""
    written = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if argument.kwarg_only or position >= len(args):
            written.append(kwargs.get(argument.name))
        else:
            written.append(args[position])
    return [leaf for value in written for leaf in tree_flatten(value)[0]]


def _materialized(value: Any) -> Any:
    return value.materialize() if isinstance(value, ParamPlaceholder) else value


def _rebuild_parameter(data: Tensor, requires_grad: bool) -> nn.Parameter:
    return nn.Parameter(data, requires_grad=requires_grad)


def _warn_grad_copy() -> None:
    # Python's default warning filter shows it once per process.
    warnings.warn(
        "megatrain: `p.grad` is a copy of the gradient summed in megatrain's store (the device never "
        "holds all gradients at once), read from host memory or disk after each backward; what you change "
        "in it is written back before the optimizer step.",
        stacklevel=3,
    )


def weight_source_of(module: nn.Module) -> WeightSource | None:
    """Where ``module``'s weights are stored, found through its placeholders (no global registry)."""
    for param in module.parameters():
        if isinstance(param, ParamPlaceholder):
            return param._source
    return None
