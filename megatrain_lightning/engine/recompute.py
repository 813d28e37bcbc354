"""The recompute rule: a block's second run sees exactly what its first run saw and changes nothing else.

A block's forward runs twice under activation checkpointing (in forward, and again in backward).
The rule follows ``torch.utils.checkpoint``'s non-reentrant semantics: both runs happen in the grad
mode the plain model would use, with the same RNG and autocast state. Beyond it, buffers the first run
changed (BatchNorm's running statistics, spectral norm's power-iteration vectors) are as they were
before it during the recompute and as the first run left them after: each forward updates them once,
as in the plain model. And each run of a checkpointed block in a training pass gets its own empty copy
of the key/value cache the model hands it (:class:`FreshCache`): ``DynamicCache.update`` appends, so a
recompute given the model's cache would attend over every key twice (or crash on a shape mismatch for
models that build explicit masks), and dropping the cache, as Hugging Face's own
``GradientCheckpointingLayer`` does, changes the rounding (``update`` returns contiguous copies of the
keys and values, which the attention's matmuls round otherwise than the views; Zamba2's Mamba2 mixers take
a fused scan without a cache). The model's own cache stays empty, so a run that would attend over keys
an earlier run appended (a layer run twice in one forward, a cache kept for a later forward) is refused.
A block that runs once (no checkpointing) and inference get the model's cache, as in the plain model.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import Tensor

# What Hugging Face layers call the cache they append to, by keyword or position.
CACHE_ARGUMENTS = frozenset({"past_key_values", "past_key_value", "layer_past", "cache"})


def training_arguments(
    module: torch.nn.Module, forward: Callable, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]]:
    """``args``/``kwargs`` for a checkpointed call of ``module``: a Hugging Face cache stands for an empty
    copy of it per run (:class:`FreshCache`); any other cache argument (a legacy tuple) is dropped, with
    ``use_cache`` off.

    Layers that only read their cache say so with HF's ``_can_checkpoint_with_cache`` and keep it.
    """
    keep_cache = getattr(module, "_can_checkpoint_with_cache", False)
    fresh = not keep_cache and any(is_cache(value) for value in (*args, *kwargs.values()))
    names = _positional_names(forward)
    new_args = tuple(
        _scrubbed(names[i] if i < len(names) else None, value, keep_cache, fresh)
        for i, value in enumerate(args)
    )
    new_kwargs = {name: _scrubbed(name, value, keep_cache, fresh) for name, value in kwargs.items()}
    return new_args, new_kwargs


def _scrubbed(name: str | None, value: Any, keep_cache: bool, fresh: bool) -> Any:
    if name == "use_cache" and value and not fresh:
        return False
    if keep_cache or value is None:
        return value
    if is_cache(value):
        if cache_length(value):
            raise RuntimeError(CACHE_IN_TRAINING.format(length=cache_length(value)))
        return FreshCache.of(value)
    if name in CACHE_ARGUMENTS:
        return None
    return value


@dataclass(eq=False)
class FreshCache:
    """A key/value cache in a checkpointed block's arguments: each run of the block (its forward and its
    recompute) gets an empty copy of it, so it computes as with the cache the plain model gives it and
    appends nothing twice. One per model cache (a forward's blocks share it)."""

    empty: Any  # a copy of the model's cache as the forward made it (it holds no positions)
    filled: dict[tuple[int, int], str] = field(default_factory=dict)  # layer of the cache -> block filling it

    @classmethod
    def of(cls, cache: Any) -> FreshCache:
        fresh = _FRESH.get(cache)
        if fresh is None:
            fresh = _FRESH[cache] = cls(copy.deepcopy(cache))
        return fresh

    def copy(self) -> Any:
        return copy.deepcopy(self.empty)

    def note_forward_run(self, block: str, run_copy: Any) -> None:
        """``block``'s forward run appended to ``run_copy``'s layers. Appending to a layer of the cache that
        an earlier run filled is refused: under plain PyTorch this run attends over that run's keys too."""
        for layer in _filled_layers(run_copy):
            if layer in self.filled:
                earlier = self.filled[layer]
                raise MisconfigurationException(
                    CACHE_FILLED_TWICE.format(block=block, earlier=earlier, layer=layer[1])
                )
            self.filled[layer] = block


def _filled_layers(cache: Any) -> list[tuple[int, int]]:
    """The layers of a Hugging Face cache holding positions, as (part, layer): an encoder-decoder's cache
    has two parts, its self-attention and its cross-attention cache."""
    parts = [getattr(cache, name, None) for name in ("self_attention_cache", "cross_attention_cache")]
    parts = [part for part in parts if part is not None] or [cache]
    return [
        (i, index)
        for i, part in enumerate(parts)
        for index, layer in enumerate(getattr(part, "layers", ()))
        if hasattr(layer, "get_seq_length") and layer.get_seq_length()  # (a layer without a cache has none)
    ]


_FRESH: weakref.WeakKeyDictionary[Any, FreshCache] = weakref.WeakKeyDictionary()


CACHE_IN_TRAINING = (
    "megatrain: a layer got a key/value cache holding {length} positions in a forward that computes "
    "gradients (a prompt encoded before, attended to by a continuation). Under activation checkpointing "
    "each layer runs again in backward, so megatrain gives each run of a layer in such forwards an empty "
    "copy of the cache (the cache such a forward returns stays empty, as under Hugging Face's gradient "
    "checkpointing), and these positions would be lost. Use "
    "`MegaTrainStrategy(activation_checkpointing=False)` to attend over a cache encoded under "
    "`torch.no_grad()`, or give the whole sequence to one forward."
)


CACHE_FILLED_TWICE = (
    "megatrain: `{block}` appended keys and values to layer {layer} of the model's key/value cache, which "
    "`{earlier}` had filled before in this forward (a layer run twice in one forward, e.g. listed twice in "
    "the model's layers) or in an earlier forward given the same cache: under plain PyTorch this run "
    "attends over those keys too. megatrain gives each run of a layer in a forward that computes gradients "
    "an empty copy of the cache (the layer runs again in backward) and routes no gradient between runs "
    "through it. Pass `use_cache=False` to the model's call in training (each run then attends over its "
    "own keys), or give the whole sequence to one forward."
)


def is_cache(value: Any) -> bool:
    cache_utils = sys.modules.get("transformers.cache_utils")  # only models that imported it pass caches
    return cache_utils is not None and isinstance(value, cache_utils.Cache)


def cache_length(value: Any) -> int:
    """The positions a Hugging Face cache holds (0 for anything else)."""
    return value.get_seq_length() if is_cache(value) else 0


@functools.cache
def _positional_names_of(function: Callable) -> tuple[str, ...]:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # builtins and the like: only keyword names are known
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in parameters if p.kind in kinds)


def _positional_names(forward: Callable) -> tuple[str, ...]:
    """Names of ``forward``'s positional parameters, ``self`` excluded for bound methods."""
    function = getattr(forward, "__func__", None)
    if function is None:
        return _positional_names_of(forward)
    return _positional_names_of(function)[1:]


BufferKey = tuple[torch.nn.Module, str]


@dataclass(frozen=True)
class ForwardState:
    """What a block's first run saw and its recompute must see again: the CPU and device RNG states and
    the CPU and device autocast settings (``torch.utils.checkpoint`` keeps the same), the modules'
    train/eval modes (a forward in ``eval()`` whose backward comes after ``train()``), the attention
    kernels allowed (``sdpa_kernel``), and the buffers the first run may have changed, as they were before
    it (filled by :func:`noting_changed_buffers`)."""

    device: torch.device
    cpu_rng: Tensor
    device_rng: Tensor | None
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    modules: tuple[torch.nn.Module, ...]
    training: tuple[bool, ...]
    attention_kernels: tuple[bool, ...]  # which of _ATTENTION_KERNELS are allowed
    buffers: dict[BufferKey, Tensor] = field(default_factory=dict)

    @classmethod
    def capture(cls, device: torch.device, module: torch.nn.Module) -> ForwardState:
        device_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        types = dict.fromkeys(("cpu", device.type))
        autocast = tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types)
        modules = tuple(module.modules())
        training = tuple(m.training for m in modules)
        kernels = _allowed_attention_kernels()
        return cls(device, torch.get_rng_state(), device_rng, autocast, modules, training, kernels)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Run with the captured RNG, autocast state and buffers; afterwards the RNG continues and the
        buffers are the objects they were before."""
        devices = [self.device] if self.device_rng is not None else []
        now = {(module, name): module._buffers.get(name, _ABSENT) for module, name in self.buffers}
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=devices, device_type=self.device.type))
            torch.set_rng_state(self.cpu_rng)
            if self.device_rng is not None:
                torch.cuda.set_rng_state(self.device_rng, self.device)
            for device_type, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            kernels = _allowed_attention_kernels()
            stack.enter_context(_switched(kernels, self.attention_kernels, _allow_attention_kernels))
            modes = [m.training for m in self.modules]
            stack.enter_context(_switched(modes, self.training, functools.partial(_set_modes, self.modules)))
            copies: dict[int, Tensor] = {}  # one copy of a tensor that several modules hold
            for (module, name), before in self.buffers.items():
                # A copy: a second backward starts from the same buffers again.
                module._buffers[name] = copies.setdefault(id(before), before.clone())
            try:
                yield
            finally:
                for (module, name), buffer in now.items():
                    if buffer is _ABSENT:  # the forward deletes it
                        module._buffers.pop(name, None)
                    else:
                        module._buffers[name] = buffer


_ABSENT = object()
# The attention kernels `torch.nn.attention.sdpa_kernel` switches on and off (for the CPU's too).
_ATTENTION_KERNELS = ("flash", "mem_efficient", "math", "cudnn")


def _allowed_attention_kernels() -> tuple[bool, ...]:
    return tuple(getattr(torch.backends.cuda, f"{name}_sdp_enabled")() for name in _ATTENTION_KERNELS)


def _allow_attention_kernels(allowed: Sequence[bool]) -> None:
    """Only the kernels ``allowed`` (not a priority order ``sdpa_kernel`` set)."""
    for name, on in zip(_ATTENTION_KERNELS, allowed, strict=True):
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(on)


def _set_modes(modules: Sequence[torch.nn.Module], training: Sequence[bool]) -> None:
    for module, mode in zip(modules, training, strict=True):
        module.training = mode


@contextlib.contextmanager
def _switched(
    now: Sequence[Any], wanted: Sequence[Any], switch: Callable[[Sequence[Any]], None]
) -> Iterator[None]:
    """``switch(wanted)`` for the duration of the context, then ``switch(now)``; nothing where they agree."""
    if list(now) == list(wanted):
        yield
        return
    switch(wanted)
    try:
        yield
    finally:
        switch(now)


@contextlib.contextmanager
def noting_changed_buffers(module: torch.nn.Module, state: ForwardState) -> Iterator[None]:
    """Run ``module``'s first run noting in ``state`` its buffers as they were before: every persistent
    buffer, copied (the state a module keeps, which some kernels update without moving the tensor's
    version: BatchNorm's), and any buffer the run replaced by another tensor (the one it replaced).
    A non-persistent buffer (a causal mask, rotary frequencies) changed in place is not noted."""
    copies: dict[int, Tensor] = {}  # one copy of a tensor that several modules hold
    before = []
    with torch.no_grad():
        for m in module.modules():
            for name, b in m._buffers.items():
                if b is None:
                    continue
                persistent = name not in m._non_persistent_buffers_set
                if persistent and id(b) not in copies:
                    copies[id(b)] = b.clone()
                before.append((m, name, b, copies[id(b)] if persistent else None))
    yield
    for m, name, buffer, saved in before:
        if saved is not None or m._buffers.get(name, _ABSENT) is not buffer:
            state.buffers[(m, name)] = buffer if saved is None else saved


ESCAPED = (
    "megatrain: a tensor computed inside a block was used outside the block's outputs (e.g. a sub-layer's "
    "output kept by a forward hook of your own) and needs gradients; megatrain pages one block at a time "
    "and routes gradients through block outputs only (and through what Hugging Face's hooks collect: "
    "router logits, attention weights, hidden states). Compute the loss from the model's outputs, or "
    "train with the default strategy."
)


def _no_saved_tensor(saved: Any) -> Tensor:
    raise RuntimeError(ESCAPED)


def discarding_saved_tensors() -> contextlib.AbstractContextManager:
    """Autograd on, but nothing kept for backward: the first run of a checkpointed block records its
    graph in the plain model's grad mode (some forwards differ by grad mode) and frees it at once."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: None, _no_saved_tensor)
