"""The engine: runs a model whose parameters live in the store, one resident block at a time.

Every call site's ``forward`` is replaced by a paged one. Without autograd (evaluation) it
binds the block's slot views into the module, runs, and unbinds. With autograd it goes
through :class:`_PagedCall`, an autograd function whose backward fetches the block again,
recomputes the block (activation checkpointing) or replays its saved graph with the weights
rebound to the new slot, computes the block's parameter gradients and offloads them at once.
The module's own parameters stay on the meta device for their whole life: shapes for whoever
asks, no storage anywhere but the store.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from megatrain_lightning.blocks import Block, CallSite, discover_blocks
from megatrain_lightning.disk import DiskStore
from megatrain_lightning.grads import HostGrads
from megatrain_lightning.hf import find_entry, weight_sources
from megatrain_lightning.io import IOConfig
from megatrain_lightning.pager import Pager
from megatrain_lightning.safetensors_io import read_into
from megatrain_lightning.stats import EngineStats
from megatrain_lightning.store import HostStore
from megatrain_lightning.timeline import TIMELINE
from megatrain_lightning.trace import UpdateCadence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    device: torch.device
    compute_dtype: torch.dtype = torch.float32
    num_slots: int = 2
    prefetch_depth: int = 1
    activation_checkpointing: bool = True
    pin_memory: bool = False
    offload_dir: str | None = None  # the disk tier, or None for the host tier
    cache_bytes: int = 0  # disk tier: host cache budget
    keep_offload_dir: bool = False
    io: IOConfig = field(default_factory=IOConfig)

    def make_store(self, blocks: list[Block], stats: EngineStats) -> HostStore:
        if self.offload_dir is None:
            return HostStore(blocks, pin_memory=self.pin_memory, stats=stats)
        return DiskStore(
            blocks,
            self.offload_dir,
            self.cache_bytes,
            kinds=["param"],
            pin_memory=self.pin_memory,
            stats=stats,
            io=self.io,
            keep=self.keep_offload_dir,
        )


# The engine that holds a module's weights, for as long as the module lives: a later Trainer (or
# strategy) over the same module continues from the same store instead of finding meta parameters.
_ENGINES: weakref.WeakKeyDictionary[nn.Module, Engine] = weakref.WeakKeyDictionary()


class Engine:
    def __init__(self, model: nn.Module, blocks: list[Block], config: EngineConfig) -> None:
        self.blocks = blocks
        self.stats = EngineStats()
        self.store = config.make_store(blocks, self.stats)
        self.grads = HostGrads(self.store, config.device, self.stats)
        self.optimizer: Any = None  # CPUAdamW once fitting
        self._cadence = UpdateCadence()
        # Qualified parameter name (every alias of a tied weight) -> (block, index in block).
        self.locations: dict[str, tuple[int, int]] = {}
        self._meta: list[list[nn.Parameter]] = []
        self._anchor = torch.zeros((), requires_grad=True)
        self._loaded_keys: set[str] = set()  # store-loaded state_dict keys (see _load_hook)
        self.config = config
        self.pager = self._make_pager(config)
        self._adopt(model)
        self._install()
        self.update_host_bytes()

    @classmethod
    def attach(
        cls,
        model: nn.Module,
        block_classes: Iterable[str | type] | None,
        make_config: Callable[[list[Block]], EngineConfig],
    ) -> Engine:
        """The engine of ``model``: created on first use, reconfigured (same store) afterwards."""
        engine = _ENGINES.get(model)
        if engine is None:
            blocks = discover_blocks(model, block_classes)
            engine = _ENGINES[model] = cls(model, blocks, make_config(blocks))
        else:
            engine.configure(make_config(engine.blocks))
        return engine

    def configure(self, config: EngineConfig) -> None:
        """New device, dtype or slot budget; the store, and so the weights, stay."""
        if config == self.config:
            return
        fixed = ("device", "pin_memory", "offload_dir", "keep_offload_dir")
        if any(getattr(config, f) != getattr(self.config, f) for f in fixed):
            raise RuntimeError(
                f"megatrain: this model's store was built for {self.config.device} with offload_dir="
                f"{self.config.offload_dir!r}; a later strategy must use the same device and tier."
            )
        self.wait_all()
        self.pager.close()
        if isinstance(self.store, DiskStore):
            self.store.resize_cache(config.cache_bytes)
        self.config = config
        self.pager = self._make_pager(config)

    def _make_pager(self, config: EngineConfig) -> Pager:
        return Pager(
            self.store,
            config.device,
            config.compute_dtype,
            config.num_slots,
            config.prefetch_depth,
            self._wait_for_update,
            self.stats,
            self._access_kinds,
        )

    # -- taking the model over --

    def _adopt(self, model: nn.Module) -> None:
        """Move each block's weights into the store (or initialize them there) and leave meta parameters."""
        aliases: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(param), []).append(name)
        init_hf = _hf_initializer(model)
        sources = weight_sources(model)
        missing = []
        for block in self.blocks:
            originals = [self._current_param(block, i) for i in range(len(block.params))]
            for index, original in enumerate(originals):
                for name in aliases[id(original)]:
                    self.locations[name] = (block.index, index)
            stored = [find_entry(sources, aliases[id(p)]) if p.is_meta else None for p in originals]
            unfilled = [
                s.name for s, p, e in zip(block.params, originals, stored, strict=True) if p.is_meta and not e
            ]
            missing += unfilled
            with self.store.pinned(block.index, "param", write=True) as flat:
                views = block.views(flat)
                if unfilled:
                    self._initialize(block, views, init_hf)
                for view, original, entry in zip(views, originals, stored, strict=True):
                    if entry is not None:
                        read_into(entry, view)
                    elif not original.is_meta:
                        view.copy_(original.detach())
            self.store.written(block.index, ["param"])
            metas = [
                nn.Parameter(torch.empty(s.shape, device="meta"), requires_grad=s.requires_grad)
                for s in block.params
            ]
            self._meta.append(metas)
            self._bind_all(block, metas)
        if sources and missing:
            log.warning(
                f"megatrain: {len(missing)} parameters are not in the checkpoint; initialized: {missing[:5]}"
            )

    def _current_param(self, block: Block, spec_index: int) -> nn.Parameter:
        for site in block.sites:
            for binding in site.bindings:
                if binding.index == spec_index:
                    return binding.owner._parameters[binding.attr]
        raise AssertionError("every block parameter has a binding")

    def _initialize(
        self, block: Block, views: list[Tensor], init_hf: Callable[[nn.Module], None] | None
    ) -> None:
        """Initialize a block built on meta directly in the store, the way its model would."""
        params = [nn.Parameter(v, requires_grad=False) for v in views]
        self._bind_all(block, params)
        with torch.no_grad():
            for site in block.sites:
                for module in site.module.modules():
                    if init_hf is not None:
                        init_hf(module)
                    elif hasattr(module, "reset_parameters"):
                        module.reset_parameters()

    @staticmethod
    def _bind_all(block: Block, tensors: list[Tensor]) -> None:
        for site in block.sites:
            for binding in site.bindings:
                binding.owner._parameters[binding.attr] = tensors[binding.index]

    def _install(self) -> None:
        """Page each call site's forward; its ``state_dict``/``load_state_dict`` read and write the store."""
        for block in self.blocks:
            for site in block.sites:
                site.module.forward = functools.partial(self._paged_forward, site, site.module.forward)
                site.module._register_state_dict_hook(functools.partial(self._state_dict_hook, site))
                site.module._register_load_state_dict_pre_hook(functools.partial(self._load_hook, site))
                site.module.register_load_state_dict_post_hook(self._forget_loaded_keys)

    def _state_dict_hook(
        self, site: CallSite, module: nn.Module, state: dict, prefix: str, meta: Any
    ) -> None:
        self.wait_all()
        views = site.block.views(self.store.read(site.block.index, "param"))
        for binding in site.bindings:
            key = prefix + binding.name
            if key in state:
                state[key] = views[binding.index]

    def _load_hook(self, site: CallSite, module: nn.Module, state: dict, prefix: str, *args: Any) -> None:
        """Copy incoming weights into the store and take their keys out of the module's hands (its
        parameters are meta); a wrong shape is left for the module to report as usual."""
        self.wait_all()
        block = site.block.index
        with self.store.pinned(block, "param", write=True) as flat:
            views = site.block.views(flat)
            for binding in site.bindings:
                key = prefix + binding.name
                value = state.get(key)
                if value is not None and value.shape == views[binding.index].shape:
                    views[binding.index].copy_(value)
                    del state[key]
                    self._loaded_keys.add(key)
        self.store.written(block, ["param"])
        self.pager.invalidate(block)

    def _forget_loaded_keys(self, module: nn.Module, incompatible: Any) -> None:
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in self._loaded_keys]
        self._loaded_keys.clear()

    def close(self) -> None:
        """Stop the worker threads and release the store (the disk tier removes its files unless kept).
        Otherwise that happens when the model is garbage-collected or the process exits."""
        if self.optimizer is not None:
            self.optimizer.close()
        self.grads.close()
        self.pager.close()
        self.store.close()

    # -- running --

    def begin_pass(self, kind: str) -> None:
        self.grads.flush()
        if kind == "train":
            self._cadence.record(self.optimizer is not None and self.optimizer.stepping)
        self.pager.begin_pass(kind)
        self.stats.trace_deviations = self.pager.trace.deviations

    def wait_all(self) -> None:
        """Wait until every gradient offload and block update issued so far is done."""
        self.grads.flush()
        if self.optimizer is not None:
            self.optimizer.wait_all()

    def update_host_bytes(self) -> None:
        self.stats.host_bytes = self.store.nbytes()

    def _access_kinds(self, backward: bool, next_pass: bool) -> tuple[str, ...]:
        """What an access uses from the store: weights; in backward also the gradient accumulator and,
        in a pass that ends in an update, the optimizer state."""
        if not backward:
            return ("param",)
        if self.optimizer is None:
            return ("param", "grad")
        updates = self._cadence.next_updates() if next_pass else self.optimizer.stepping
        return self.optimizer.update_kinds if updates else ("param", "grad")

    def _wait_for_update(self, block: int) -> None:
        if self.optimizer is not None:
            self.optimizer.wait(block)

    def _paged_forward(self, site: CallSite, forward: Callable, *args: Any, **kwargs: Any) -> Any:
        flat, spec = tree_flatten((args, kwargs))
        positions = [i for i, leaf in enumerate(flat) if isinstance(leaf, Tensor)]
        tensors = [flat[i] for i in positions]
        trains = any(p.requires_grad for p in site.block.params) or any(t.requires_grad for t in tensors)
        call = _Call(forward, flat, spec, positions)
        if not (torch.is_grad_enabled() and trains):
            with self._resident(site, backward=False, grad=False), TIMELINE.span("compute"):
                return forward(*args, **kwargs)
        outputs = _PagedCall.apply(self, site, call, self._anchor, *tensors)
        return call.rebuild_outputs(outputs)

    @contextlib.contextmanager
    def _resident(
        self, site: CallSite, backward: bool, grad: bool
    ) -> Iterator[tuple[Tensor, dict[int, Tensor]]]:
        """Bind ``site``'s parameters to slot views for the duration of the context."""
        block = site.block
        slot = self.pager.acquire(block.index, backward)
        try:
            tensors = {}
            for index in site.param_indices:
                p = block.params[index]
                view = slot[p.offset : p.offset + p.numel].view(p.shape)
                tensors[index] = view.detach().requires_grad_(p.requires_grad) if grad else view
            for binding in site.bindings:
                binding.owner._parameters[binding.attr] = tensors[binding.index]
            yield slot, tensors
        finally:
            for binding in site.bindings:
                binding.owner._parameters[binding.attr] = self._meta[block.index][binding.index]
            self.pager.release(block.index)

    def _offload(
        self, site: CallSite, leaves: dict[int, Tensor], grads: list[Tensor | None], last_use: bool
    ) -> None:
        """Send a call's parameter gradients to the host; at the block's last use, signal the optimizer."""
        block = site.block
        found = {index: g for index, g in zip(leaves, grads, strict=True) if g is not None}
        ready = functools.partial(self._block_ready, block.index) if last_use else _nothing
        if last_use and self.optimizer is not None:
            self.optimizer.wait_for_room()
        if found:
            # Without a trace to say otherwise, a block with one call site is used once per pass.
            final = last_use or (not self.pager.trace.following and len(block.sites) == 1)
            self.grads.offload(block.index, found, final, ready)
        else:
            ready()

    def _block_ready(self, block: int) -> None:
        if self.optimizer is not None:
            self.optimizer.block_ready(block)


def _nothing() -> None:
    return None


@dataclass(eq=False)
class _Call:
    """One call of a call site: the non-tensor arguments, and afterwards the non-tensor outputs."""

    forward: Callable
    flat: list[Any]
    spec: Any
    positions: list[int]
    out_flat: list[Any] = field(default_factory=list)
    out_spec: Any = None
    out_positions: list[int] = field(default_factory=list)

    def run(self, tensors: tuple[Tensor, ...] | list[Tensor]) -> list[Tensor]:
        flat = list(self.flat)
        for i, t in zip(self.positions, tensors, strict=True):
            flat[i] = t
        args, kwargs = tree_unflatten(flat, self.spec)
        out_flat, self.out_spec = tree_flatten(self.forward(*args, **kwargs))
        self.out_positions = [i for i, leaf in enumerate(out_flat) if isinstance(leaf, Tensor)]
        self.out_flat = [None if i in self.out_positions else leaf for i, leaf in enumerate(out_flat)]
        return [out_flat[i] for i in self.out_positions]

    def rebuild_outputs(self, tensors: tuple[Tensor, ...]) -> Any:
        flat = list(self.out_flat)
        for i, t in zip(self.out_positions, tensors, strict=True):
            flat[i] = t
        return tree_unflatten(flat, self.out_spec)


def _detached(tensors: tuple[Tensor, ...] | list[Tensor]) -> list[Tensor]:
    return [t.detach().requires_grad_(t.requires_grad) for t in tensors]


@dataclass(frozen=True)
class _SlotRef:
    """A saved tensor that was a view of the block's slot: rebuilt from whichever slot holds it later."""

    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class _PagedCall(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, engine: Engine, site: CallSite, call: _Call, anchor: Tensor, *tensors: Tensor
    ) -> Any:
        ctx.engine, ctx.site, ctx.call = engine, site, call
        device_type = engine.config.device.type
        ctx.autocast = (
            device_type,
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
        )
        if engine.config.activation_checkpointing:
            ctx.rng = _rng_state(engine.config.device)
            with engine._resident(site, backward=False, grad=False), TIMELINE.span("compute"):
                outputs = call.run(tensors)
            ctx.save_for_backward(*tensors)
        else:
            with engine._resident(site, backward=False, grad=True) as (slot, leaves):
                inputs = _detached(tensors)
                slot_storage = slot.untyped_storage().data_ptr()
                # unpack reads the slot through a holder, not ctx: ctx -> graph -> hook -> ctx would be a
                # cycle through C++ that the garbage collector cannot see (a forward without backward leaked).
                holder: list[Tensor] = []
                ctx.slot_holder = holder

                def pack(t: Tensor) -> Any:
                    if t.device == slot.device and t.untyped_storage().data_ptr() == slot_storage:
                        return _SlotRef(t.size(), t.stride(), t.storage_offset())
                    return t

                def unpack(saved: Any) -> Tensor:
                    if isinstance(saved, _SlotRef):
                        return holder[0].as_strided(saved.size, saved.stride, saved.offset)
                    return saved

                with (
                    torch.enable_grad(),
                    torch.autograd.graph.saved_tensors_hooks(pack, unpack),
                    TIMELINE.span("compute"),
                ):
                    outputs = call.run(inputs)
            ctx.graph = (outputs, inputs, leaves)
        ctx.mark_non_differentiable(*[o for o in outputs if not o.is_floating_point()])
        ctx.set_materialize_grads(False)
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor | None) -> Any:
        engine: Engine = ctx.engine
        site, call = ctx.site, ctx.call
        block = site.block.index
        checkpointed = engine.config.activation_checkpointing
        with (
            engine._resident(site, backward=True, grad=checkpointed) as (slot, bound),
            TIMELINE.span("compute"),
        ):
            last_use = engine.pager.is_last_use(block)
            if checkpointed:
                inputs = _detached(ctx.saved_tensors)
                leaves = bound
                device_type, enabled, dtype = ctx.autocast
                with (
                    torch.enable_grad(),
                    _restored_rng(engine.config.device, ctx.rng),
                    torch.autocast(device_type, dtype=dtype, enabled=enabled),
                ):
                    outputs = call.run(inputs)
            else:
                ctx.slot_holder[:] = [slot]
                outputs, inputs, leaves = ctx.graph
            pairs = [
                (o, g)
                for o, g in zip(outputs, grad_outputs, strict=True)
                if g is not None and o.requires_grad
            ]
            wrt_inputs = [t for t in inputs if t.requires_grad]
            wrt_leaves = {i: t for i, t in leaves.items() if t.requires_grad}
            wrt = wrt_inputs + list(wrt_leaves.values())
            if pairs and wrt:
                grads = torch.autograd.grad(
                    [o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True
                )
            else:
                grads = (None,) * len(wrt)
        if not checkpointed:
            del ctx.graph
        engine._offload(site, wrt_leaves, list(grads[len(wrt_inputs) :]), last_use)
        input_grads = iter(grads[: len(wrt_inputs)])
        return (None, None, None, None, *[next(input_grads) if t.requires_grad else None for t in inputs])


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _restored_rng(device: torch.device, state: tuple[Tensor, Tensor | None]) -> Iterator[None]:
    """Replay the forward's random numbers (dropout) during recomputation, then restore the RNG."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def _hf_initializer(model: nn.Module) -> Callable[[nn.Module], None] | None:
    """The ``_init_weights`` of the outermost Hugging Face model inside ``model``, if any."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module._init_weights
    return None
