"""Initial weights of a model built on the meta device equal to those of a plain build with the same seed.

A plain build draws random numbers twice per weight: as each module is constructed (``reset_parameters``,
``nn.init`` calls in ``__init__``) and again in Hugging Face's ``post_init``, in an order fixed by the
module tree. The store is filled block by block in another order, so drawing afresh there gives other
weights. :class:`InitRecorder` instead watches the meta build: every in-place op on a parameter is
recorded with the random-number state it starts from, and the same op runs on a CPU scratch tensor so
the generator advances exactly as in a plain build (later code sees the same random stream). Replaying
a parameter's ops on its real tensor then gives the plain build's values in any order, one block at a
time, without ever holding the whole model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from megatrain_lightning.serialization.meta import building_on_meta
from megatrain_lightning.store.memory import host_empty

# In-place ops that draw from the global generator (``generator=None``).
_RANDOM_OPS = frozenset(
    f"aten.{name}_"
    for name in (
        "normal",
        "uniform",
        "random",
        "bernoulli",
        "exponential",
        "cauchy",
        "log_normal",
        "geometric",
    )
)


_active = threading.local()  # the recorder this thread's ops go to


@dataclass(frozen=True)
class _Op:
    func: Any  # an aten OpOverload
    args: tuple[Any, ...]  # after the target tensor; weights on meta among them as :class:`_Source`
    kwargs: dict[str, Any]
    geometry: tuple[tuple[int, ...], tuple[int, ...], int]  # the part of the weight's storage it writes
    rng_state: Tensor | None  # the generator state the op starts from (random ops only)

    def apply(self, target: Tensor) -> None:
        size, stride, offset = self.geometry
        target = target.as_strided(size, stride, target.storage_offset() + offset)
        args, kwargs = _materialized((self.args, self.kwargs))
        if self.rng_state is not None:
            torch.set_rng_state(self.rng_state)
        self.func(target, *args, **kwargs)


@dataclass(frozen=True)
class _Source:
    """A weight on meta that a recorded op reads (``resize_token_embeddings`` copies the old embedding's rows
    into the new one): a part of it as its first ``count`` recorded ops leave it."""

    ops: list[_Op]  # the weight's record (it may grow later; the source is its first ``count``)
    count: int
    numel: int  # of the weight's storage
    dtype: torch.dtype
    geometry: tuple[tuple[int, ...], tuple[int, ...], int]

    def materialize(self) -> Tensor:
        """Its values, the generator left as it was (replaying a random op sets its state)."""
        state = torch.get_rng_state()
        try:
            storage = torch.empty(self.numel, dtype=self.dtype)
            for op in self.ops[: self.count]:
                op.apply(storage)
        finally:
            torch.set_rng_state(state)
        return storage.as_strided(*self.geometry)


def _materialized(value: Any) -> Any:
    return tree_map(lambda v: v.materialize() if isinstance(v, _Source) else v, value)


def _geometry(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset()


def _storage_key(t: Tensor) -> int:
    """A meta tensor's storage: what its views and ``.data`` aliases share, and what ``p.data = q.data`` (as
    ``resize_token_embeddings`` swaps the new embedding into the old parameter) hands over."""
    return t.untyped_storage()._cdata


def _is_meta(value: Any) -> bool:
    return isinstance(value, Tensor) and value.is_meta


def _on_cpu(value: Any) -> Any:
    return torch.device("cpu") if isinstance(value, torch.device) and value.type == "meta" else value


# Factories of uninitialized memory: nothing to compute (a weight made so gets its values from its record).
_EMPTY = frozenset(
    (
        torch.ops.aten.empty,
        torch.ops.aten.empty_strided,
        torch.ops.aten.empty_like,
        torch.ops.aten.new_empty,
        torch.ops.aten.new_empty_strided,
    )
)


class InitRecorder(TorchDispatchMode):
    """Record the initialization of parameters built on meta; :meth:`install` makes them replayable.

    Use around a build under megatrain's meta context::

        with InitRecorder() as recorder:
            model = AutoModelForCausalLM.from_config(config)
        recorder.install(model)
        ...
        initialize(module, model._init_weights)  # each module, once its parameters are real

    Ops are recorded by the storage they write, so a view's or a ``.data`` alias's ops are the weight's,
    and a weight handed to another parameter (``p.data = q.data``) keeps its record. Tensors the build
    computes on meta that are not weights (Mamba's ``torch.arange(..., device=A_log.device)`` and
    ``torch.rand`` of its ``dt``; the mean and covariance of the old embedding that
    ``resize_token_embeddings`` draws the new rows from) are computed on the CPU too, as in a plain build:
    random ones draw the same numbers, and ``.item()`` reads them. An op that reads a weight reads it as
    its record so far leaves it.
    """

    def __init__(self) -> None:
        super().__init__()
        self._ops: dict[int, list[_Op]] = {}  # a weight's meta storage (:func:`_storage_key`) -> its ops
        self._values: dict[int, Tensor] = {}  # a computed meta tensor's storage -> its values on the CPU
        self._keep: list[Tensor] = []  # the recorded tensors stay alive, so their storages stay unique
        self._nested = False

    def __enter__(self) -> InitRecorder:
        """Inside another recorder this one shares its record: recording twice would draw twice."""
        outer = getattr(_active, "recorder", None)
        if outer is not None:
            self._ops, self._values, self._keep = outer._ops, outer._values, outer._keep
            self._nested = True
            return self
        _active.recorder = self
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._nested:
            return
        _active.recorder = None
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else None
        if not building_on_meta():  # suspended (Hugging Face's from_pretrained builds its own way)
            return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default and _is_meta(target):
            return self._value(target).item()
        writes_meta = _is_meta(target) and func._schema.is_mutable
        if writes_meta and _storage_key(target) not in self._values:
            self._record(func, target, args[1:], kwargs)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        made = [t for t in tree_flatten(out)[0] if _is_meta(t) and t is not target]
        made = [t for t in made if all(_storage_key(t) != _storage_key(i) for i in inputs if i.is_meta)]
        # Computed: what computes from tensors on meta, and factories with values (an `empty` one has none,
        # and a real tensor moved to meta is a parameter being made).
        computes = any(i.is_meta for i in inputs) or not (inputs or func.overloadpacket in _EMPTY)
        if writes_meta or (made and computes):
            self._compute(func, args, kwargs, out, made)
        return out

    def _record(self, func: Any, target: Tensor, args: tuple, kwargs: dict) -> None:
        """An in-place op on a weight: recorded to replay, and the generator advanced as a plain build's."""
        rng_state = None
        if str(func.overloadpacket) in _RANDOM_OPS and kwargs.get("generator") is None:
            rng_state = torch.get_rng_state()
            # An anonymous map, returned to the system when freed: heap scratch of every size stays in RSS.
            extent = target.untyped_storage().nbytes() // target.element_size()
            scratch = host_empty(extent, target.dtype).as_strided(*_geometry(target))
            func(scratch, *args, **kwargs)  # advance the generator as a plain build does
        recorded = tree_map(self._source, (args, kwargs))
        self._ops.setdefault(_storage_key(target), []).append(
            _Op(func, *recorded, _geometry(target), rng_state)
        )
        self._keep.append(target)

    def _compute(self, func: Any, args: tuple, kwargs: dict, out: Any, made: list[Tensor]) -> None:
        """``func`` on the CPU values of its meta arguments: the values of the tensors it ``made`` (or, in
        place, of the computed tensor it changes)."""
        values = tree_map(lambda v: self._value(v) if _is_meta(v) else _on_cpu(v), (args, kwargs))
        real = func(*values[0], **values[1])
        for fake, value in zip(tree_flatten(out)[0], tree_flatten(real)[0], strict=True):
            if any(fake is t for t in made):
                self._values[_storage_key(fake)] = value
                self._keep.append(fake)

    def _value(self, t: Tensor) -> Tensor:
        """The values of meta tensor ``t``: computed, or its weight's as the record so far leaves them."""
        computed = self._values.get(_storage_key(t))
        if computed is not None:
            return computed.as_strided(*_geometry(t))
        return self._source(t).materialize()

    def _source(self, value: Any) -> Any:
        """A recorded op's argument as replay needs it: a weight on meta as its record so far, a computed
        tensor as a copy of its values now."""
        if not _is_meta(value):
            return value
        computed = self._values.get(_storage_key(value))
        if computed is not None:
            return computed.as_strided(*_geometry(value)).clone()
        ops = self._ops.setdefault(_storage_key(value), [])
        numel = value.untyped_storage().nbytes() // value.element_size()
        self._keep.append(value)
        return _Source(ops, len(ops), numel, value.dtype, _geometry(value))

    def install(self, root: nn.Module) -> None:
        """Let every module inside ``root`` (e.g. a LightningModule whose ``configure_model`` ran under the
        recorder) replay the recorded ops of its own parameters: :func:`initialize`. Modules added
        later keep their own initialization.

        A parameter with several names (tied weights) replays under the first only; ops on tensors the
        finished model no longer holds (a head replaced by tying) were drawn and are dropped, as in plain.
        """
        seen: set[int] = set()
        for module in root.modules():
            own: dict[str, list[_Op]] = {}
            for name, param in module._parameters.items():
                if param is None or id(param) in seen:
                    continue
                seen.add(id(param))
                own[name] = self._replay(param) if param.is_meta else []
            module.__dict__[_RECORDED] = own

    def _replay(self, param: Tensor) -> list[_Op]:
        """What gives ``param`` its values: its record, or a copy of what was computed for it (a parameter
        made from a computed tensor, e.g. ``nn.Parameter(torch.ones(n, device="meta"))``)."""
        computed = self._values.get(_storage_key(param))
        if computed is None:
            return self._ops.get(_storage_key(param), [])
        value = computed.as_strided(*_geometry(param))
        return [_Op(torch.ops.aten.copy_.default, (value,), {}, _geometry(param), None)]


_RECORDED = "_megatrain_recorded_init"  # a module's own parameters' recorded ops, by name


def initialize(module: nn.Module, model_init: Callable[[nn.Module], None] | None) -> None:
    """Give ``module``'s own parameters their recorded values, leaving the generator as it was; a module
    that was not there when the recorder was installed gets its model's initialization (``model_init``,
    e.g. Hugging Face's ``_init_weights``), else its own ``reset_parameters``."""
    own = module.__dict__.get(_RECORDED)
    if own is None:
        if model_init is not None:
            model_init(module)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()
        return
    state = torch.get_rng_state()
    try:
        with torch.no_grad():
            for name, ops in own.items():
                for op in ops:
                    op.apply(module._parameters[name])
    finally:
        torch.set_rng_state(state)
