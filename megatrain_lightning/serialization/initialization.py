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
    args: tuple[Any, ...]  # after the target tensor
    kwargs: dict[str, Any]
    geometry: tuple[tuple[int, ...], tuple[int, ...], int] | None  # view of the parameter, or None: all of it
    rng_state: Tensor | None  # the generator state the op starts from (random ops only)

    def apply(self, target: Tensor) -> None:
        if self.geometry is not None:
            size, stride, offset = self.geometry
            target = target.as_strided(size, stride, target.storage_offset() + offset)
        if self.rng_state is not None:
            torch.set_rng_state(self.rng_state)
        self.func(target, *self.args, **self.kwargs)


class InitRecorder(TorchDispatchMode):
    """Record the initialization of parameters built on meta; :meth:`install` makes them replayable.

    Use around a build under megatrain's meta context::

        with InitRecorder() as recorder:
            model = AutoModelForCausalLM.from_config(config)
        recorder.install(model)
        ...
        initialize(module, model._init_weights)  # each module, once its parameters are real
    """

    def __init__(self) -> None:
        super().__init__()
        self._ops: dict[int, list[_Op]] = {}  # id(meta parameter or its base) -> ops, in order
        self._keep: list[Tensor] = []  # the recorded tensors stay alive, so their ids stay unique
        self._nested = False

    def __enter__(self) -> InitRecorder:
        """Inside another recorder this one shares its record: recording twice would draw twice."""
        outer = getattr(_active, "recorder", None)
        if outer is not None:
            self._ops, self._keep, self._nested = outer._ops, outer._keep, True
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
        if not (
            building_on_meta()  # not while suspended (Hugging Face's from_pretrained builds its own way)
            and isinstance(target, Tensor)
            and target.is_meta
            and func._schema.is_mutable
            and not any(isinstance(a, Tensor) and a.is_meta for a in (*args[1:], *kwargs.values()))
        ):
            return func(*args, **kwargs)
        base = target if target._base is None else target._base
        geometry = None
        if target is not base:
            geometry = (
                tuple(target.shape),
                tuple(target.stride()),
                target.storage_offset() - base.storage_offset(),
            )
        rng_state = None
        if str(func.overloadpacket) in _RANDOM_OPS and kwargs.get("generator") is None:
            rng_state = torch.get_rng_state()
            # An anonymous map, returned to the system when freed: heap scratch of every size stays in RSS.
            extent = 1 + sum(
                (size - 1) * stride for size, stride in zip(base.shape, base.stride(), strict=True)
            )
            scratch = host_empty(extent, base.dtype).as_strided(base.shape, base.stride())
            if geometry is not None:
                scratch = scratch.as_strided(geometry[0], geometry[1], geometry[2])
            func(scratch, *args[1:], **kwargs)  # advance the generator as a plain build does
        self._ops.setdefault(id(base), []).append(_Op(func, args[1:], kwargs, geometry, rng_state))
        self._keep.append(base)
        return func(*args, **kwargs)

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
                own[name] = self._ops.get(id(param), [])
            module.__dict__[_RECORDED] = own


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
