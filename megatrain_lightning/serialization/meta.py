"""Building models without memory: parameters on the meta device, buffers real."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Generator

from torch import nn

_state = threading.local()


def building_on_meta() -> bool:
    """Whether code runs inside :func:`init_on_meta` (e.g. ``configure_model`` under megatrain)."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def init_on_meta() -> Generator[None, None, None]:
    """Create parameters on the meta device and buffers for real (``init_empty_weights`` style):
    the store fills the parameters block by block; buffers such as rotary ``inv_freq`` keep their
    computed values."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            meta = module._parameters[name].to("meta")
            module._parameters[name] = type(param)(meta, requires_grad=param.requires_grad)

    outermost = not building_on_meta()
    if outermost:
        nn.Module.register_parameter = register_on_meta
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
        if outermost:
            nn.Module.register_parameter = register
