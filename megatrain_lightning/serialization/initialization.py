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

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from megatrain_lightning.serialization.meta import MetaBuildFunctions, building_on_meta
from megatrain_lightning.store.memory import host_empty

_active = threading.local()  # the recorder this thread's ops go to


Geometry = tuple[tuple[int, ...], tuple[int, ...], int]  # size, stride, storage offset


@dataclass(frozen=True)
class _Op:
    """An in-place op on a tensor's storage, recorded to replay on the real tensor."""

    func: Any  # an aten OpOverload
    args: tuple[Any, ...]  # the written tensor as :data:`_TARGET`; others on meta as :class:`_Source`
    kwargs: dict[str, Any]
    geometry: Geometry  # the part of the storage it writes
    rng_state: Tensor | None  # the state its generator starts from (random ops only)

    def apply(self, target: Tensor) -> None:
        size, stride, offset = self.geometry
        target = target.as_strided(size, stride, target.storage_offset() + offset)
        args, kwargs = _materialized((self.args, self.kwargs), target)
        with _drawing_from(kwargs.get("generator"), self.rng_state):
            self.func(*args, **kwargs)


@dataclass(frozen=True)
class _Made:
    """How a tensor on meta that is not a weight was made: an op on other tensors (Mamba's
    ``torch.log(A)``, a resize's covariance of the old rows) or a factory with values (``torch.arange``,
    ``torch.rand``), computed on the CPU when its values are needed."""

    func: Any
    args: tuple[Any, ...]  # tensors on meta as :class:`_Source`; the meta device as the CPU
    kwargs: dict[str, Any]
    output: int  # which of the op's tensors
    rng_state: Tensor | None

    def value(self) -> Tensor:
        args, kwargs = _materialized((self.args, self.kwargs))
        with _drawing_from(kwargs.get("generator"), self.rng_state):
            return tree_flatten(self.func(*args, **kwargs))[0][self.output]


@dataclass
class _Storage:
    """A meta storage: how it was made (nothing: a weight, from ``empty``) and the ops that wrote it."""

    numel: int
    dtype: torch.dtype
    made: tuple[_Made, Geometry] | None = None
    ops: list[_Op] = field(default_factory=list)
    from_files: bool = False  # its values come from checkpoint files once the build is over

    def values(self, count: int) -> Tensor:
        """Its values after its first ``count`` ops, as a flat CPU tensor not to be written. Each state is
        computed once per reading (``spectral_norm``'s power method reads each vector's last state: else
        its whole history at each step), none kept after it (a weight's would hold the model in RAM).
        Without a record it has no values (a weight loaded from files later, one never initialized): a
        clear error, where a plain build reads the values it has (a read of its shape alone reads none)."""
        if self.from_files or (self.made is None and count == 0):
            raise MisconfigurationException(
                "megatrain: the model built in `configure_model` reads the values of a tensor on the meta "
                "device that megatrain cannot know there (a weight loaded from checkpoint files later, one "
                "never initialized): a copy, a cast or an `.item()` of it. Do this after `fit`, or build "
                "the model in the LightningModule's `__init__`."
            )
        with _one_reading() as computed:
            states = computed.setdefault(id(self), {})
            if count in states:
                return states[count]
            start = max((done for done in states if done < count), default=None)
            if start is not None:
                flat = states[start].clone()
            else:
                start, flat = 0, torch.empty(self.numel, dtype=self.dtype)
                if self.made is not None:
                    made, geometry = self.made
                    flat.as_strided(*geometry).copy_(made.value())
            for op in self.ops[start:count]:
                op.apply(flat)
            states[count] = flat
            return flat


@contextlib.contextmanager
def _one_reading() -> Generator[dict[int, dict[int, Tensor]], None, None]:
    """The states computed in the outermost :meth:`_Storage.values` running on this thread, by storage
    and count of ops."""
    outermost = getattr(_active, "computed", None) is None
    if outermost:
        _active.computed = {}
    try:
        yield _active.computed
    finally:
        if outermost:
            _active.computed = None


@dataclass(frozen=True)
class _Source:
    """A tensor on meta that a recorded op reads (the old embedding's rows a resize copies), as its
    storage's first ``count`` ops left it."""

    storage: _Storage
    count: int
    geometry: Geometry

    def materialize(self) -> Tensor:
        return self.storage.values(self.count).as_strided(*self.geometry)


@dataclass(frozen=True)
class _Shaped:
    """A tensor on meta that an op reads for its shape and dtype alone (``torch.zeros_like(w)``)."""

    geometry: Geometry
    dtype: torch.dtype

    @classmethod
    def of(cls, t: Tensor) -> _Shaped:
        size, stride, _ = _geometry(t)
        return cls((size, stride, 0), t.dtype)

    def materialize(self) -> Tensor:
        size, stride, _ = self.geometry
        return torch.empty_strided(size, stride, dtype=self.dtype)


_TARGET = object()  # where a recorded op's written tensor goes: its first argument, or `out=` (`torch.eye`)


def _materialized(value: Any, target: Tensor | None = None) -> Any:
    def real(v: Any) -> Any:
        if v is _TARGET:
            return target
        return v.materialize() if isinstance(v, (_Source, _Shaped)) else v

    return tree_map(real, value)


def _written(func: Any, args: tuple, kwargs: dict) -> Tensor | None:
    """The tensor on meta that ``func`` writes, if any: its first argument (``normal_``, ``copy_``) or
    its ``out=`` (``torch.eye(n, out=w)``, as ``nn.init.eye_`` writes)."""
    if not func._schema.is_mutable:
        return None
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[position] if position < len(args) else kwargs.get(argument.name)
            return value if _is_meta(value) else None
    return None


def _geometry(t: Tensor) -> Geometry:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset()


def _storage_key(t: Tensor) -> int:
    """A meta tensor's storage: what its views and ``.data`` aliases share, and what ``p.data = q.data`` (as
    ``resize_token_embeddings`` swaps the new embedding into the old parameter) hands over."""
    return t.untyped_storage()._cdata


def _is_meta(value: Any) -> bool:
    return isinstance(value, Tensor) and value.is_meta


def _on_cpu(value: Any) -> Any:
    return torch.device("cpu") if isinstance(value, torch.device) and value.type == "meta" else value


def _draws(func: Any) -> bool:
    """Whether ``func`` draws random numbers: an op of which some form takes a generator (``rand``,
    ``normal_``, ``bernoulli``)."""
    return _takes_a_generator(func.overloadpacket)


def _generator_state(kwargs: dict[str, Any]) -> Tensor:
    """The state of the generator a random op draws from: the one it is given (``generator=``), else
    the global one."""
    generator = kwargs.get("generator")
    return torch.get_rng_state() if generator is None else generator.get_state()


@contextlib.contextmanager
def _drawing_from(generator: torch.Generator | None, state: Tensor | None) -> Generator[None, None, None]:
    """Run a recorded op from the generator state it was recorded with (``state``; None: it draws
    nothing), and leave the generator as it was: a replay changes no random stream."""
    if state is None:
        yield
        return
    now = torch.get_rng_state() if generator is None else generator.get_state()
    set_state = torch.set_rng_state if generator is None else generator.set_state
    set_state(state)
    try:
        yield
    finally:
        set_state(now)


@functools.cache
def _takes_a_generator(packet: Any) -> bool:
    return any(
        argument.name == "generator"
        for overload in packet.overloads()
        for argument in getattr(packet, overload)._schema.arguments
    )


def _packets(*names: str) -> frozenset[Any]:
    return frozenset(getattr(torch.ops.aten, name) for name in names)


# Factories of uninitialized memory: nothing to compute (a weight made so gets its values from its ops).
_EMPTY = _packets("empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided")
# Ops that read a tensor for its shape and dtype alone.
_SHAPE_ONLY = _packets(
    "zeros_like",
    "ones_like",
    "full_like",
    "rand_like",
    "randn_like",
    "randint_like",
    "new_zeros",
    "new_ones",
    "new_full",
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
    and a weight handed to another parameter (``p.data = q.data``) keeps its record. A tensor the build
    computes on meta (Mamba's ``torch.arange(..., device=A_log.device)`` and ``torch.rand`` of its
    ``dt``; the mean and covariance of the old embedding that ``resize_token_embeddings`` draws the new
    rows from) is recorded as how it was made, and computed on the CPU where its values are needed: when
    its weight is replayed, and at once for ``.item()``. A random one draws at once too, so the generator
    advances as in a plain build. An op reads another tensor as that tensor's record so far leaves it.
    """

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, _Storage] = {}  # by :func:`_storage_key`
        self._keep: list[torch.UntypedStorage] = []  # every recorded storage, kept alive
        self._unwritten: set[int] = set()  # see :meth:`_track_unwritten`
        self._nested = False
        self._functions = MetaBuildFunctions()

    def __enter__(self) -> InitRecorder:
        """Inside another recorder this one shares its record: recording twice would draw twice."""
        outer = getattr(_active, "recorder", None)
        if outer is not None:
            self._storages, self._keep, self._unwritten = outer._storages, outer._keep, outer._unwritten
            self._nested = True
            return self
        _active.recorder = self
        self._functions.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._nested:
            return
        _active.recorder = None
        super().__exit__(*exc)
        self._functions.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else None
        if not building_on_meta():  # suspended (Hugging Face's from_pretrained builds its own way)
            return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default and _is_meta(target):
            return self._source(target).materialize().item()
        written = _written(func, args, kwargs)
        if written is not None:
            self._record(func, written, args, kwargs)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        taken = {_storage_key(i) for i in inputs if i.is_meta}  # a view shares its input's storage
        made = [i for i, t in enumerate(tree_flatten(out)[0]) if _is_meta(t) and _storage_key(t) not in taken]
        if made and func.overloadpacket not in _EMPTY and not self._reads_unwritten(inputs):
            self._made(func, args, kwargs, out, made)
        self._track_unwritten(func, inputs, out)
        return out

    def _track_unwritten(self, func: Any, inputs: list[Tensor], out: Any) -> None:
        """Keep :attr:`_unwritten` current: the CPU storages ``empty`` made that nothing wrote since.

        A parameter made on the CPU and registered under megatrain's meta build (``nn.Linear``'s
        ``torch.empty``, a user's ``nn.Parameter(torch.randn(n, d))``) is moved to meta; its values are kept
        as how it was made unless it is such an unwritten storage (its init writes it on meta later, and
        keeping every weight's memory would keep the model in RAM). Values made on the CPU are kept, as a
        plain build holds them."""
        real = [t for t in inputs if not t.is_meta]
        if func._schema.is_mutable:  # written (a read argument counted too: its values are kept)
            for t in real:
                self._unwritten.discard(_storage_key(t))
        taken = {_storage_key(t) for t in real}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, Tensor) or t.is_meta or _storage_key(t) in taken:
                continue
            key = _storage_key(t)
            if func.overloadpacket in _EMPTY:
                self._unwritten.add(key)
                weakref.finalize(t.untyped_storage(), self._unwritten.discard, key)  # no stale key later
            else:
                self._unwritten.discard(key)

    def _reads_unwritten(self, inputs: list[Tensor]) -> bool:
        return any(not t.is_meta and _storage_key(t) in self._unwritten for t in inputs)

    def _storage(self, t: Tensor) -> _Storage:
        key = _storage_key(t)
        if key not in self._storages:
            self._keep.append(t.untyped_storage())  # its key stays unique (a tensor's may change: `.data =`)
            numel = t.untyped_storage().nbytes() // t.element_size()
            self._storages[key] = _Storage(numel, t.dtype)
        return self._storages[key]

    def _record(self, func: Any, target: Tensor, args: tuple, kwargs: dict) -> None:
        """An op writing ``target``, a tensor on meta: recorded to replay, and the generator advanced as a
        plain build's."""
        storage = self._storage(target)
        args, kwargs = tree_map(lambda v: _TARGET if v is target else v, (args, kwargs))
        rng_state = None
        if _draws(func):
            rng_state = _generator_state(kwargs)
            # An anonymous map, returned to the system when freed: heap scratch of every size stays in RSS.
            scratch = host_empty(storage.numel, target.dtype).as_strided(*_geometry(target))
            drawn_args, drawn_kwargs = _materialized((args, kwargs), scratch)
            func(*drawn_args, **drawn_kwargs)  # advance the generator as a plain build does
        recorded = tree_map(self._source, (args, kwargs))
        storage.ops.append(_Op(func, *recorded, _geometry(target), rng_state))

    def _made(self, func: Any, args: tuple, kwargs: dict, out: Any, made: list[int]) -> None:
        """Record how ``func`` made its outputs ``made`` (indices of its tensors)."""
        source = _Shaped.of if func.overloadpacket in _SHAPE_ONLY else self._source
        arguments = tree_map(lambda v: source(v) if _is_meta(v) else _on_cpu(v), (args, kwargs))
        rng_state = None
        if _draws(func):
            rng_state = _generator_state(kwargs)
            func(*_materialized(arguments[0]), **_materialized(arguments[1]))  # draw as a plain build does
        tensors = tree_flatten(out)[0]
        for index in made:
            self._storage(tensors[index]).made = (
                _Made(func, *arguments, index, rng_state),
                _geometry(tensors[index]),
            )

    def _source(self, value: Any) -> Any:
        """A recorded op's argument as replay needs it: a tensor on meta as its record so far."""
        if not _is_meta(value):
            return value
        storage = self._storage(value)
        return _Source(storage, len(storage.ops), _geometry(value))

    def from_files(self, weights: list[Tensor]) -> None:
        """``weights`` get their values from checkpoint files after the build: none to read before."""
        for weight in weights:
            self._storage(weight).from_files = True

    def install(self, root: nn.Module) -> None:
        """Let every module inside ``root`` (e.g. a LightningModule whose ``configure_model`` ran under the
        recorder) replay the recorded ops of its own parameters: :func:`initialize`. Modules added
        later keep their own initialization. A buffer made on meta (``torch.arange(n, device=w.device)``,
        ``spectral_norm``'s vectors) gets its values now: buffers are real, as in a plain build.

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
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_meta:  # made on a weight's device: `device=w.device`
                    module._buffers[name] = self._source(buffer).materialize().clone()

    def _replay(self, param: Tensor) -> list[_Op]:
        """What gives ``param`` its values: its ops, or, for a parameter made from a computed tensor
        (``nn.Parameter(torch.ones(n, device="meta"))``), a copy of that tensor's values."""
        storage = self._storages.get(_storage_key(param))
        if storage is None:
            return []
        if storage.made is None:
            return storage.ops
        whole = _Source(storage, len(storage.ops), _geometry(param))
        return [_Op(torch.ops.aten.copy_.default, (_TARGET, whole), {}, _geometry(param), None)]


def loaded_from_files(weights: list[Tensor]) -> None:
    """Tell the recorder of this thread's meta build, if any, that ``weights`` are filled from files."""
    recorder = getattr(_active, "recorder", None)
    if recorder is not None:
        recorder.from_files(weights)


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
    with torch.no_grad():
        for name, ops in own.items():
            for op in ops:
                op.apply(module._parameters[name])
    module.__dict__[_RECORDED] = {}  # replayed: the record (values made on the CPU among it) is freed
