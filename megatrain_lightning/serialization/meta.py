"""Building models without memory: parameters on the meta device, buffers real; Hugging Face's
``from_pretrained``, which loads values, builds for real; torch's functions that act otherwise on meta
than on the CPU act as on the CPU while the build is recorded (:class:`MetaBuildFunctions`)."""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Generator
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

_state = threading.local()


def building_on_meta() -> bool:
    """Whether code runs inside :func:`init_on_meta` (e.g. ``configure_model`` under megatrain)."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def init_on_meta() -> Generator[None, None, None]:
    """Create parameters on the meta device and buffers for real (``init_empty_weights`` style):
    the store fills the parameters block by block; buffers such as rotary ``inv_freq`` keep their
    computed values. Hugging Face's ``from_pretrained`` inside loads as it does outside
    (:func:`_pretrained_loads_for_real`)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            meta = module._parameters[name].to("meta")  # a recorder keeps the values made on the CPU
            module._parameters[name] = type(param)(meta, requires_grad=param.requires_grad)

    outermost = not building_on_meta()
    with _pretrained_loads_for_real() if outermost else contextlib.nullcontext():
        if outermost:
            _state.plain_register = register
            nn.Module.register_parameter = register_on_meta
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            yield
        finally:
            _state.depth -= 1
            if outermost:
                nn.Module.register_parameter = register


@contextlib.contextmanager
def building_for_real() -> Generator[None, None, None]:
    """Suspend :func:`init_on_meta` inside it: parameters created here are real."""
    depth = getattr(_state, "depth", 0)
    if depth == 0:
        yield
        return
    on_meta = nn.Module.register_parameter
    nn.Module.register_parameter = _state.plain_register
    _state.depth = 0
    try:
        yield
    finally:
        _state.depth = depth
        nn.Module.register_parameter = on_meta


@contextlib.contextmanager
def _pretrained_loads_for_real() -> Generator[None, None, None]:
    """Hugging Face's ``from_pretrained`` inside a meta build (megatrain's ``configure_model``) loads its
    weights as under the default strategy: built on meta they would be lost (and the ``kernels`` package
    cannot kernelize a meta model). The whole model is then in RAM once before megatrain's store takes it
    over, so a warning points to ``megatrain_lightning.from_pretrained``, which streams it block by block.
    A resize of such a real model's embeddings (``resize_token_embeddings``) builds the new ones for real."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.__dict__["from_pretrained"]
    load = original.__func__
    resize = PreTrainedModel.resize_token_embeddings

    @functools.wraps(resize)
    def resizing(model: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
        embeddings = model.get_input_embeddings()
        if building_on_meta() and embeddings is not None and not embeddings.weight.is_meta:
            with building_for_real():
                return resize(model, *args, **kwargs)
        return resize(model, *args, **kwargs)

    @functools.wraps(load)
    def loading(cls: type, *args: Any, **kwargs: Any) -> Any:
        if not building_on_meta():
            return load(cls, *args, **kwargs)
        rank_zero_warn(
            f"megatrain: `{cls.__name__}.from_pretrained` in `configure_model` loads the whole model into "
            "RAM before megatrain's store takes it over, as under the default strategy; "
            "`megatrain_lightning.from_pretrained(path)` reads each block's weights from the shards "
            "straight into the store instead."
        )
        with building_for_real():
            return load(cls, *args, **kwargs)

    PreTrainedModel.from_pretrained = classmethod(loading)
    PreTrainedModel.resize_token_embeddings = resizing
    try:
        yield
    finally:
        PreTrainedModel.from_pretrained = original
        PreTrainedModel.resize_token_embeddings = resize


# torch.nn.init's functions that return at once for a tensor on meta (``trunc_normal_``, ``orthogonal_``,
# ``sparse_``, ``dirac_``): a plain build draws there, so a meta build that skips them starts from other
# weights, and every weight drawn after them differs too.
_INITS_SKIPPING_META = frozenset(
    function.__code__
    for function in vars(nn.init).values()
    if callable(function) and "is_meta" in getattr(getattr(function, "__code__", None), "co_names", ())
)
_IS_META = torch._C.TensorBase.__dict__["is_meta"].__get__  # compared with `==`: a new wrapper per access
_SET_DATA = torch._C.TensorBase.__dict__["data"].__set__


_FROM_DATA = frozenset({torch.tensor, torch.as_tensor, Tensor.new_tensor})


class MetaBuildFunctions(TorchFunctionMode):
    """What the recorder cannot see below torch's functions, while a meta build is recorded:

    * torch.nn.init's functions that return at once for a tensor on meta are told it is not: their ops then
      run on it and are recorded as any other init's (the draws, a QR, a rejection loop's ``.any()``, which
      the recorder computes on the CPU);
    * a tensor made on meta from Python data (``torch.tensor(values, device=w.device)``) is made on the CPU
      and moved, so the recorder keeps its values (made on meta its values are not dispatched);
    * a CPU tensor given to a parameter on meta by ``w.data = values`` is moved there (torch refuses the
      two devices), its values kept as a parameter's made on the CPU."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not building_on_meta():
            return func(*args, **kwargs)
        if func == _IS_META and sys._getframe(1).f_code in _INITS_SKIPPING_META:
            return False
        if func == _SET_DATA and _on_meta(args[0]) and not _on_meta(args[1]):
            return func(args[0], args[1].to("meta"))  # `w.data = values`: the values kept as made
        out = func(*args, **kwargs)
        if func in _FROM_DATA and _on_meta(out) and not _holds_a_tensor(args, kwargs, func):
            return func(*args, **{**kwargs, "device": "cpu"}).to("meta")
        return out


def _holds_a_tensor(args: tuple, kwargs: dict, func: Any) -> bool:
    """Whether the data ``func`` makes a tensor from holds tensors (whose ops the recorder sees)."""
    data = args[1:] if func is Tensor.new_tensor else args
    return any(isinstance(v, Tensor) for v in tree_flatten((data, kwargs))[0])


def _on_meta(value: Any) -> bool:
    return isinstance(value, Tensor) and value.is_meta
