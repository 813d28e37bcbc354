"""What a module's parameters are between block calls: placeholders that know where the weights are.

Under megatrain a parameter's numbers live in the store and visit the device only while its block
runs. Outside its block the module holds a :class:`ParamPlaceholder` in its place: a tensor without
storage that reports the shape, the compute device and the dtype the default strategy would show
(Llama-4 moves its inputs to ``embed_tokens.weight.device``; ``model.dtype`` picks mask values), and
keeps the user's ``requires_grad`` flag (unfreezing callbacks set it). Reading its *values* (a
weight-norm callback, ``copy.deepcopy`` for an EMA copy, an L2 penalty in ``training_step``) gives a copy
read from the store; with autograd on, the gradient autograd sums in the placeholder joins the block's
(:mod:`.outside_uses`). Changing it in place (``p.mul_``, ``p.data = v``, ``p[i] = v``, an
optimizer of the user's after ``fit``) changes the copy and writes it into the store, as the weights of a
plain parameter change. Its views (``p[0]``, ``p.view(-1)``) are placeholders too, that read and write
the parameter (``nn.init.orthogonal_`` writes through one).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map


class WeightSource(Protocol):
    """What a placeholder asks about its weights (:class:`~.weights.StoredWeights` answers)."""

    engine: Any  # the engine training the module now, or None

    def read_param(self, block: int, index: int) -> Tensor: ...

    def note_outside_use(self, placeholder: ParamPlaceholder, func: Any) -> None: ...

    def write_param(self, block: int, index: int, value: Tensor) -> None: ...

    def user_grad(
        self, block: int, index: int, device: torch.device, dtype: torch.dtype
    ) -> Tensor | None: ...

    def assign_grad(self, block: int, index: int, value: Tensor | None) -> None: ...


@dataclass(frozen=True, eq=False)
class _ViewStep:
    """One view op applied to a placeholder (``p[0]``, ``p.view(-1)``, ``p.split(n)[1]``)."""

    func: Any
    args: tuple
    kwargs: dict
    output: int | None  # which of the op's outputs, for ops that return several views

    def __call__(self, tensor: Tensor) -> Tensor:
        out = self.func(tensor, *self.args, **self.kwargs)
        return out if self.output is None else out[self.output]


class ParamPlaceholder(Tensor):
    """Stands for parameter ``index`` of ``block`` in the engine's store (see the module docstring), or
    for a view of it (``_views``): a view reads and writes the parameter through the store, as a view of a
    plain parameter reads and writes its storage."""

    _source: WeightSource
    _block: int
    _index: int
    _name: str
    _parameter: ParamPlaceholder | None  # what a view is a view of
    _views: tuple[_ViewStep, ...]

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
        t._parameter, t._views = None, ()
        return t

    @classmethod
    def make_parameter(
        cls, source: WeightSource, block: int, index: int, name: str, **meta: Any
    ) -> nn.Parameter:
        """A placeholder that ``isinstance(..., nn.Parameter)`` accepts, as modules hold them."""
        requires_grad = meta.pop("requires_grad", True)
        return nn.Parameter(cls(source, block, index, name, **meta), requires_grad=requires_grad)

    def _like(self, dtype: torch.dtype | None = None, device: torch.device | None = None) -> ParamPlaceholder:
        if self._views:  # `view.detach()`: the same view
            return self._parameter._view_of(self._views, self)
        return ParamPlaceholder(
            self._source,
            self._block,
            self._index,
            self._name,
            self.shape,
            dtype or self.dtype,
            device or self.device,
        )

    def _view_of(self, views: tuple[_ViewStep, ...], like: Tensor) -> ParamPlaceholder:
        """A placeholder for this parameter seen through ``views``, with the geometry of ``like``."""
        t = Tensor._make_wrapper_subclass(
            ParamPlaceholder,
            like.shape,
            strides=like.stride(),
            storage_offset=like.storage_offset(),
            dtype=like.dtype,
            device=self.device,
        )
        t._source, t._block, t._index, t._name = self._source, self._block, self._index, self._name
        t._parameter, t._views = self, views
        return t

    def _viewed(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func``, a view op, applied to this placeholder: placeholders for the views it returns."""
        parameter = self._root
        meta = torch.empty(parameter.shape, dtype=parameter.dtype, device="meta")
        for step in self._views:
            meta = step(meta)
        out = func(meta, *args, **kwargs)
        if isinstance(out, Tensor):
            return parameter._view_of((*self._views, _ViewStep(func, args, kwargs, None)), out)
        return [
            parameter._view_of((*self._views, _ViewStep(func, args, kwargs, i)), view)
            for i, view in enumerate(out)
        ]

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        if self._views:
            return repr(self.materialize())
        return (
            f"megatrain parameter {self._name} (shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}; weights in the store)"
        )

    def materialize(self) -> Tensor:
        """A copy of the current weights (of the view), in this placeholder's dtype and on its device."""
        return self._seen_in(self._read_parameter())

    def _read_parameter(self) -> Tensor:
        parameter = self._root
        return self._source.read_param(self._block, self._index).to(parameter.device, parameter.dtype)

    def _seen_in(self, weights: Tensor) -> Tensor:
        """What this placeholder shows of the parameter's ``weights``: a view of them."""
        for step in self._views:
            weights = step(weights)
        return weights

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
            if func.is_view:
                return first._viewed(func, args[1:], kwargs)
        # One copy of each parameter per op (`p.add_(p.data)` sees its own change); views are its views.
        weights: dict[tuple, Tensor] = {}
        seen: dict[int, ParamPlaceholder] = {}

        def materialized(value: Any) -> Any:
            if not isinstance(value, ParamPlaceholder):
                return value
            value._note_use(func)
            key = value._key
            if key not in weights:
                weights[key] = value._read_parameter()
            view = value._seen_in(weights[key])
            seen[id(view)] = value
            return view

        args, kwargs = tree_map(materialized, args), tree_map(materialized, kwargs)
        shapes = {key: w.shape for key, w in weights.items()}
        result = func(*args, **kwargs)
        written = [w for w in _written_arguments(func, args, kwargs) if id(w) in seen]
        # Any placeholder of a parameter writes the parameter's whole copy back, views' changes included.
        for key, placeholder in {seen[id(w)]._key: seen[id(w)] for w in written}.items():
            if weights[key].shape != shapes[key]:
                raise RuntimeError(
                    f"megatrain: {func} would change the shape of `{placeholder._name}`; megatrain keeps "
                    "each parameter's shape. Rebuild the model to change it."
                )
            placeholder._write(weights[key])
        # An in-place op returns what it changed: the parameter (or view), not its copy.
        returned = {id(w): seen[id(w)] for w in written}
        return tree_map(lambda value: returned.get(id(value), value), result)

    @property
    def _root(self) -> ParamPlaceholder:
        """The parameter's own placeholder (this one, unless this is a view)."""
        return self if self._parameter is None else self._parameter

    @property
    def _key(self) -> tuple:
        parameter = self._root
        return self._block, self._index, parameter.dtype, parameter.device

    def __setitem__(self, key: Any, value: Any) -> None:
        """``p[i] = v`` into the store: one read and one write of the parameter, whatever the index. A
        parameter that requires grad is refused with autograd on, by torch itself, as a plain one is."""
        weights = self._read_parameter()
        self._seen_in(weights).requires_grad_(self.requires_grad)[key] = value
        self._write(weights)

    @property
    def data(self) -> Tensor:  # type: ignore[override]
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value: Tensor) -> None:
        """``p.data = v`` (``vector_to_parameters`` does it) sets the weights in the store: a placeholder
        has no data of its own to replace. A placeholder of the same parameter (the strategy converting
        the module for bf16-true, ``Module._apply``) replaces what this one reports, as torch does."""
        if isinstance(value, ParamPlaceholder) and not self._views and value._key[:2] == self._key[:2]:
            torch._C.TensorBase.data.__set__(self, value)
            return
        if isinstance(value, ParamPlaceholder) or self._views:
            raise RuntimeError(
                f"megatrain: `.data` of `{self._name}`{' (a view of it)' if self._views else ''} cannot be "
                "replaced by another tensor's storage (tying weights after megatrain paged the model): "
                "its weights live in megatrain's store. Tie weights before `fit` (one `nn.Parameter` in "
                "both modules), or set values with `p.data = tensor` / `p.copy_(...)`."
            )
        if (value.shape, value.dtype, value.device) != (self.shape, self.dtype, self.device):
            raise RuntimeError(
                f"megatrain: `{self._name}.data` assigned a tensor of shape {tuple(value.shape)}, "
                f"{value.dtype}, on {value.device}; megatrain keeps the parameter's shape, dtype and device "
                f"({tuple(self.shape)}, {self.dtype}, on {self.device}). Set its values instead; to change "
                "shapes (`resize_token_embeddings`) do it before `fit`, or on `copy.deepcopy(model)`, a "
                "plain model with the trained weights."
            )
        self._write(value)

    def _write(self, weights: Tensor) -> None:
        self._source.write_param(self._block, self._index, weights)

    def _note_use(self, func: Any) -> None:
        """A read with autograd on uses the weights outside their block: the engine takes the gradient."""
        if torch.is_grad_enabled() and self.requires_grad:
            self._source.note_outside_use(self._root, func)

    @property
    def grad(self) -> Tensor | None:  # type: ignore[override]
        """A copy of the gradient summed in the store (warned once), the same tensor while user code holds
        it; what user code changes in it is written back (:mod:`.user_grads`). ``None`` when there is none.
        ``zero_grad`` (of a module, which Lightning calls before each validation, or of an optimizer) reads it
        without a warning: it only looks whether there is one to clear; so does ``Module._apply`` (a cast or
        move that leaves the module paged, as ``.float()`` of an fp32 model). Without an engine (the trainer
        gone, a training loop of the user's) autograd keeps it in the placeholder, as in a plain parameter;
        a view has none, as a plain view."""
        if self._views or self._source.engine is None:
            return torch._C.TensorBase.grad.__get__(self)
        reader = sys._getframe(1).f_code
        quiet = reader in _ZERO_GRADS or reader is _MODULE_APPLY
        with warnings.catch_warnings() if quiet else contextlib.nullcontext():
            if quiet:
                warnings.simplefilter("ignore")
            grad = self._source.user_grad(self._block, self._index, self.device, self.dtype)
        if reader in _ZERO_GRADS and grad is None:  # it clears what is there: a sum its update used, too
            self._source.assign_grad(self._block, self._index, None)
        if grad is not None and not quiet:
            _warn_grad_copy()
        return grad

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        if self._views or self._source.engine is None:
            torch._C.TensorBase.grad.__set__(self, value)
            return
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
_ZERO_GRADS = {nn.Module.zero_grad.__code__, inspect.unwrap(torch.optim.Optimizer.zero_grad).__code__}
_MODULE_APPLY = nn.Module._apply.__code__


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


def note_uses_as_arguments(tensors: list[Any]) -> None:
    """Weights handed to a block's call as they are (a learned prefix given to every layer) are used outside
    their layer: the call computes on their values read from the store (``materialize``), and the engine
    takes the gradient autograd sums in them (:mod:`.outside_uses`)."""
    for tensor in tensors:
        if isinstance(tensor, ParamPlaceholder):
            tensor._note_use("an argument of a layer's call")


def weight_source_of(module: nn.Module) -> WeightSource | None:
    """Where ``module``'s weights are stored, found through its placeholders (no global registry)."""
    for param in module.parameters():
        if isinstance(param, ParamPlaceholder):
            return param._source
    return None
