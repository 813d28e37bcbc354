"""The engine: runs a model whose parameters live in the store, one resident block at a time.

Every call site's ``forward`` is replaced by a paged one. Without autograd (evaluation) it
binds the block's slot views into the module, runs, and unbinds. With autograd it goes
through :class:`.paged_call.PagedCall`, an autograd function whose backward fetches the block again,
recomputes the block (activation checkpointing) or replays its saved graph with the weights
rebound to the new slot, computes the block's parameter gradients and offloads them at once.

Data flows one way. The engine drives each step: it asks the pager for a block (the pager reads
the store), runs it, hands the gradients to the offload (which adds them into the store) and, at a
block's last use, submits its update to the optimizer (which changes the store). None of them calls
back up: an update announces itself to the store (``HostStore.will_change``), which is how loads wait
for it and how device copies know they are stale.

Between calls the module holds placeholders (:mod:`megatrain_lightning.engine.placeholders`) in place of
its parameters: shapes, device and dtype for whoever asks, no storage anywhere but the store. What a
block's recompute may see is :mod:`megatrain_lightning.engine.recompute`'s rule.

Threads and locks (the contract every part keeps):

- the compute thread (Lightning's) runs forward and backward, acquires and releases slots, offloads
  gradients (inline on the CPU) and submits block updates; it is the only one that calls the engine;
- the pager's prefetch worker copies blocks into free slots. Slots and the resident map are guarded
  by ``Pager._cond``; the trace is written and read by the compute thread only;
- the gradient-offload worker (CUDA) adds copied gradients into the store and submits the block's
  update; ``flush`` waits for all of its work before anyone reads the sums;
- the optimizer's workers run block updates (:mod:`megatrain_lightning.optim.updates` guards what is
  pending; on the CPU over a store in RAM there are none: updates run in the compute thread); a block's
  buffers are touched only by its update, or by a thread that waited for it;
- every worker pool comes from :mod:`megatrain_lightning.engine.threads`, which keeps workers' OpenMP
  teams off the compute thread's cores;
- the disk tier's I/O workers read and write block files; its cache is guarded by ``DiskStore._cond``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from megatrain_lightning.engine.adopt import adopt
from megatrain_lightning.engine.blocks import CallSite, discover_blocks
from megatrain_lightning.engine.distributed import (
    Shard,
    ShardedDiskStore,
    ShardedGrads,
    ShardedHostStore,
)
from megatrain_lightning.engine.forward_changes import ForwardChanges, version_of
from megatrain_lightning.engine.gathers import GatheredBlocks
from megatrain_lightning.engine.grads import HostGrads
from megatrain_lightning.engine.host_views import HostViews, ShadowViews
from megatrain_lightning.engine.outside_uses import OutsideUses
from megatrain_lightning.engine.paged_call import Call, PagedCall, off_slot
from megatrain_lightning.engine.pager import Pager
from megatrain_lightning.engine.placeholders import note_uses_as_arguments, weight_source_of
from megatrain_lightning.engine.recompute import training_arguments
from megatrain_lightning.engine.shared_inputs import SharedInputs
from megatrain_lightning.engine.slots import Pools, SlotLayout, slot_pools
from megatrain_lightning.engine.trace import PendingBackwards, UpdateCadence
from megatrain_lightning.engine.weights import StoredWeights
from megatrain_lightning.store.disk import DiskStore
from megatrain_lightning.store.host import HostStore
from megatrain_lightning.store.io import IOConfig
from megatrain_lightning.store.layout import Block
from megatrain_lightning.telemetry.stats import EngineStats
from megatrain_lightning.telemetry.timeline import TIMELINE


@dataclass(frozen=True)
class EngineConfig:
    device: torch.device
    compute_dtype: torch.dtype = torch.float32
    mixed_precision: bool = False  # bf16-mixed: bf16 slots only for what autocast casts (engine/slots.py)
    slot_pools: Pools | None = None  # (slot bytes, count) per size (engine/slots.py); None: a slot per block
    prefetch_depth: int = 1
    activation_checkpointing: bool = True
    pin_memory: bool = False
    offload_dir: str | None = None  # the disk tier, or None for the host tier
    cache_bytes: int = 0  # disk tier: host cache budget
    keep_offload_dir: bool = False
    io: IOConfig = field(default_factory=IOConfig)
    zero_copy: bool = True  # where the device is the host, compute on the store's weights (host_views.py)
    shard: Shard | None = None  # data parallel: this rank's share of every block (engine/distributed.py)

    @property
    def binds_store(self) -> bool:
        """Whether blocks compute on the store's buffers themselves, not on slot copies: the CPU with the
        host tier (the fp32 weights; in bf16 the bf16 shadow where a slot holds bf16, :mod:`.host_views`)."""
        return self.zero_copy and self.device.type == "cpu" and self.offload_dir is None

    @property
    def keeps_shadow(self) -> bool:
        """Whether the host tier keeps a bf16 shadow of the weights for the device (store/host.py)."""
        narrow = self.compute_dtype != torch.float32 or self.mixed_precision
        return self.offload_dir is None and narrow and self.shard is None

    def make_store(self, blocks: list[Block], stats: EngineStats) -> HostStore:
        if self.offload_dir is None:
            # In chunks only where they pay: the shadow's refresh reads each chunk the update just wrote
            # while it is in cache; otherwise a chunk only cuts an update into more, smaller calls.
            chunked = self.io.host_chunks or self.keeps_shadow
            chunk = self.io.chunk_numel if chunked else max(b.numel for b in blocks)
            if self.shard is not None:
                return ShardedHostStore(self.shard, blocks, stats, chunk)
            return HostStore(blocks, self.pin_memory, stats, chunk)
        disk_store = DiskStore if self.shard is None else functools.partial(ShardedDiskStore, self.shard)
        return disk_store(
            blocks,
            self.offload_dir,
            self.cache_bytes,
            kinds=["param"],
            pin_memory=self.pin_memory,
            stats=stats,
            io=self.io,
            keep=self.keep_offload_dir,
        )


class Engine:
    """Runs one module over the store; owned by the strategy that trains it (see :mod:`.weights`)."""

    def __init__(
        self,
        model: nn.Module,
        blocks: list[Block],
        config: EngineConfig,
        weights: StoredWeights | None = None,
    ) -> None:
        """``weights``: the store of a module an earlier engine adopted (a later ``fit``); else ``model``'s
        weights move into a new store."""
        self.blocks = blocks
        self.stats = EngineStats()
        if weights is None:
            weights = StoredWeights(config.make_store(blocks, self.stats), blocks, config)
        else:
            _check_same_tier(weights.built_for, config)
            weights.store.stats = self.stats
            _resize_cache(weights.store, config)
        self.weights = weights
        self.store = weights.store
        self.locations = weights.locations
        self.grads = (ShardedGrads if config.shard is not None else HostGrads)(
            self.store, config.device, self.stats
        )
        self.optimizer: Any = None  # CPUAdamW once fitting
        self._cadence = UpdateCadence()
        self.backwards = PendingBackwards()  # this pass's training calls awaiting their backward
        self.shared_inputs = SharedInputs()  # tensors several calls take: their gradient summed use by use
        self.forward_changes = ForwardChanges(self.store, data_parallel=config.shard is not None)
        self._anchor = torch.zeros((), requires_grad=True)
        self.outside_uses = OutsideUses(self.grads, data_parallel=config.shard is not None)
        self._block_calls = 0  # block calls running (nested: a block inside another's call)
        # A trainer runs with the engine (from `attach` to `settle`): the module's weights are the store's,
        # so a cast or move of the module now is refused instead of taking them out (`StoredWeights.release`).
        self.in_use = True
        self.config = config
        self.pager = self._make_pager(config)
        if not weights.placeholders:
            adopt(self, model)
            weights.install_hooks()
        weights.attach(self)
        # Gradients and optimizer state are this engine's: freed with it (the weights stay with the module).
        weakref.finalize(self, _release_training_state, weakref.ref(weights))
        self.update_host_bytes()

    @classmethod
    def attach(
        cls,
        model: nn.Module,
        block_classes: Iterable[str | type] | None,
        make_config: Callable[[list[Block]], EngineConfig],
    ) -> Engine:
        """The engine of ``model``: created on first use; reconfigured while the engine that holds it
        lives; built anew on the same store once that engine is gone."""
        weights = weight_source_of(model)
        if isinstance(weights, StoredWeights):
            weights.store.forget_read_failures()
            config = make_config(weights.blocks)
            engine = weights.engine
            if engine is None:
                return cls(model, weights.blocks, config, weights)
            engine.configure(config)
            engine.in_use = True
            return engine
        blocks = discover_blocks(model, block_classes)
        return cls(model, blocks, make_config(blocks))

    def configure(self, config: EngineConfig) -> None:
        """New device, dtype or slot budget; the store, and so the weights, stay."""
        if config == self.config:
            return
        _check_same_tier(self.config, config)
        self.drop_optimizer()
        self.grads.flush()
        self.pager.close()
        del self.pager  # its slots are freed before the new pager allocates its own
        _resize_cache(self.store, config)
        self.config = config
        self.pager = self._make_pager(config)

    def _make_pager(self, config: EngineConfig) -> Pager | HostViews:
        layout = SlotLayout(self.blocks, config.compute_dtype, config.mixed_precision)
        if config.shard is not None:
            return GatheredBlocks(self.store, self.stats, layout, config.device, config.prefetch_depth)
        # Slots on the host tier copy the bf16 runs rounded already (the disk tier's convert the fp32 read).
        shadow = layout.shadow_runs if config.keeps_shadow else None
        self.store.define_shadow(shadow, joined=config.binds_store)
        if config.binds_store:
            return (
                ShadowViews(self.store, self.stats, layout) if shadow else HostViews(self.store, self.stats)
            )
        pools = slot_pools(layout.block_bytes) if config.slot_pools is None else config.slot_pools
        return Pager(self.store, config.device, layout, pools, config.prefetch_depth, self.stats)

    # -- what the module's side asks (see megatrain_lightning.engine.weights) --

    def close(self, materialize: bool | None = None) -> None:
        """Stop the worker threads, give the module plain parameters back and release the store (the disk
        tier removes its files unless kept). The host tier's parameters become its weights in RAM; the
        disk tier's, in general too large for RAM, become meta tensors (save or export before) unless
        ``materialize``. Without ``close`` that happens when the module is garbage-collected or the
        process exits."""
        self.grads.close()  # first: a pending offload may still submit an update
        self.drop_optimizer()
        self.pager.close()
        if materialize is None:
            materialize = not isinstance(self.store, DiskStore)
        self.weights.give_back(materialize)
        self.store.close()

    def settle(self) -> None:
        """The trainer's run with the engine ended: wait for its pending work, write the disk tier back; the
        module may leave megatrain from now on."""
        self.in_use = False
        self.wait_all()
        self.store.flush()

    # -- running --

    def begin_pass(self, kind: str) -> None:
        self.grads.flush()
        self.outside_uses.begin_pass()
        if kind == "train":
            self.weights.train_on()
            self._cadence.record(self.optimizer is not None and self.optimizer.stepping)
        self.pager.begin_pass(kind)
        self.backwards.clear()
        self.stats.trace_deviations = self.pager.trace.deviations

    def schedule_state(self) -> dict[str, Any]:
        """What the engine learned of the passes (traces, update cadence), saved with a checkpoint: a resumed
        run then pages ahead and updates at each block's last use from its first step, instead of a step
        without a trace, which defers every update to its end (on the disk tier its gradients spill)."""
        return {"trace": self.pager.trace.state_dict(), "cadence": self._cadence.state_dict()}

    def load_schedule_state(self, state: dict[str, Any]) -> None:
        self.pager.trace.load_state_dict(state["trace"])
        self._cadence.load_state_dict(state["cadence"])

    def wait_all(self) -> None:
        """Wait until every gradient offload and block update issued so far is done."""
        self.grads.flush()
        if self.optimizer is not None:
            self.optimizer.wait_all()

    def drop_optimizer(self) -> None:
        """Close the optimizer of a run that ended (a failure of its updates reached the user with it)."""
        if self.optimizer is not None:
            self.optimizer.close()
            self.optimizer = None

    def end_stopped_run(self) -> None:
        """A failure stopped the run and is on its way to the user: from now on the store's blocks are
        read as they are, and failed reads may be tried again."""
        if self.optimizer is not None:  # its step's updates so far stay: the weights are between steps
            self.weights.between_steps = self.optimizer.updated_before_a_failure
        self.drop_optimizer()
        self.store.forget_read_failures()

    def update_host_bytes(self) -> None:
        self.stats.host_bytes = self.store.nbytes() + self.grads.staging_bytes

    def _access_kinds(self, backward: bool, next_pass: bool) -> tuple[str, ...]:
        """What an access uses from the store: weights; in backward also the gradient accumulator and,
        in a pass that ends in an update, the optimizer state."""
        if not backward:
            return ("param",)
        if self.optimizer is None:
            return ("param", "grad")
        updates = self._cadence.next_updates() if next_pass else self.optimizer.stepping
        return self.optimizer.update_kinds if updates else ("param", "grad")

    def _hint_store(self) -> None:
        """Tell the store what the trace predicts, each access with the kinds it uses (a disk tier ranks
        its cache and reads ahead by it)."""
        this_pass, next_pass = self.pager.trace.future()
        # Lazily: the host tier has no cache and never iterates it (this runs on every block fetch).
        self.store.hint(
            itertools.chain(
                ((block, self._access_kinds(backward, False)) for block, backward in this_pass),
                ((block, self._access_kinds(backward, True)) for block, backward in next_pass),
            )
        )

    def pages_calls_now(self) -> bool:
        """Whether a block's call now runs paged. Not under ``bf16-mixed`` outside autocast (a hook of the
        user's, ``generate`` after ``fit``, an fp32 head under ``autocast(enabled=False)``): the default
        strategy computes there in fp32 on its fp32 weights, which the slots do not hold; the placeholders
        read the fp32 masters from the store instead, op by op (slower: warned)."""
        if not self.config.mixed_precision or torch.is_autocast_enabled(self.config.device.type):
            return True
        # Python's default warning filter shows it once per process.
        warnings.warn(
            "megatrain: under `bf16-mixed` a call of the model outside autocast (a hook of yours, `generate` "
            "after `fit`, `autocast(enabled=False)`) computes in fp32, as under the default strategy, on the "
            "fp32 weights read from megatrain's store op by op: slower than a paged call. Wrap it in "
            f"`torch.autocast({self.config.device.type!r}, dtype=torch.bfloat16)` to compute in bf16.",
            stacklevel=4,
        )
        return False

    def paged_forward(self, site: CallSite, forward: Callable, *args: Any, **kwargs: Any) -> Any:
        """One call of ``site``: with its block resident and bound when nothing needs gradients (evaluation),
        else as a :class:`PagedCall` (the training path, under the recompute rule)."""
        placeholders = self.weights.placeholders[site.block.index]
        trains = any(placeholders[i].requires_grad for i in site.param_indices) or any(
            t.requires_grad for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)
        )
        if not (torch.is_grad_enabled() and trains):
            with self.resident(site, backward=False, grad=False) as (slot, _), TIMELINE.span("compute"):
                return off_slot(forward(*args, **kwargs), slot)
        if self.config.activation_checkpointing:  # a block that runs once keeps its cache, as in plain
            args, kwargs = training_arguments(site.module, forward, args, kwargs)
        flat, spec = tree_flatten((args, kwargs))
        note_uses_as_arguments(flat)
        positions = [i for i, leaf in enumerate(flat) if isinstance(leaf, Tensor)]
        call = Call(site.block.name, forward, flat, spec, positions)
        outputs = PagedCall.apply(self, site, call, self._anchor, *[flat[i] for i in positions])
        return call.rebuild_outputs(outputs)

    @contextlib.contextmanager
    def resident(
        self, site: CallSite, backward: bool, grad: bool
    ) -> Iterator[tuple[Tensor, dict[int, Tensor]]]:
        """Bind ``site``'s parameters to slot views for the duration of the context; what a forward changed
        in them is kept (:mod:`.forward_changes`)."""
        block = site.block
        slot = self.pager.acquire(block.index, backward)
        version = version_of(slot)
        placeholders = self.weights.placeholders[block.index]
        self._block_calls += 1
        try:
            self._hint_store()
            tensors = {}
            for index in site.param_indices:
                view = self.pager.view(block.index, index, slot)
                tensors[index] = (
                    view.detach().requires_grad_(placeholders[index].requires_grad) if grad else view
                )
            for binding in site.bindings:
                binding.owner._parameters[binding.attr] = tensors[binding.index]
            before = self.forward_changes.before(site, tensors, backward)
            yield slot, tensors
            moved = version_of(slot) != version
            changed = self.forward_changes.after(site, tensors, backward, moved, before)
        finally:
            self._block_calls -= 1
            for binding in site.bindings:
                binding.owner._parameters[binding.attr] = placeholders[binding.index]
            self.pager.release(block.index)
        if changed:
            self.forward_changes.keep(site, changed)

    def note_outside_use(self, placeholder: Tensor, func: Any) -> None:
        """``placeholder`` used outside its block's calls with autograd on (see :mod:`.outside_uses`);
        refused inside another block's call, whose gradients are its own weights'."""
        if self._block_calls:
            raise RuntimeError(
                f"megatrain: `{placeholder._name}` was read inside the call of a layer that does not own "
                f"it ({func}), with autograd on; megatrain takes a layer's gradients for its own weights "
                "only, so this one's would be lost. Name the module that reads it in "
                "`MegaTrainStrategy(block_classes=...)`, so that both are one block."
            )
        self.outside_uses.note(placeholder)

    def outside_grad_arrived(self, placeholder: Tensor) -> None:
        """Autograd summed a gradient in ``placeholder``, used outside its block (:mod:`.outside_uses`)."""
        updating = self.optimizer is not None and self.optimizer.updates.submitted(placeholder._block)
        self.outside_uses.arrived(placeholder, updating)

    def offload(
        self, site: CallSite, leaves: dict[int, Tensor], grads: list[Tensor | None], last_use: bool
    ) -> None:
        """Send a call's parameter gradients to the host; at the block's last use, signal the optimizer
        (unless this backward brings the block a gradient from a use of its weights outside it too: the
        block's gradient is final at the backward's end)."""
        block = site.block
        if last_use and self.outside_uses.used:  # weights used outside their blocks
            last_use = not self.outside_uses.awaited(block.index)
        if self.optimizer is not None and self.optimizer.updates.submitted(block.index):
            raise RuntimeError(
                f"megatrain: block {block.index} got gradients after its update began: a second backward "
                "through one forward (`retain_graph=True`) in automatic optimization is not supported."
            )
        found = {index: g for index, g in zip(leaves, grads, strict=True) if g is not None}
        optimizer = self.optimizer if last_use else None
        ready = functools.partial(optimizer.block_ready, block.index) if optimizer is not None else _nothing
        if optimizer is not None:
            optimizer.wait_for_room()
            optimizer.claim_gradients(block.index)
        # Data parallel: every rank joins the block's reduction, with gradients of its own or none.
        if found or self.config.shard is not None:
            self.grads.offload(block.index, found, last_use, ready)
        else:
            ready()


def _nothing() -> None:
    return None


def _check_same_tier(built_for: EngineConfig, config: EngineConfig) -> None:
    fixed = ("device", "pin_memory", "offload_dir", "keep_offload_dir", "shard")
    if any(getattr(config, f) != getattr(built_for, f) for f in fixed):
        raise MisconfigurationException(
            f"megatrain: this model's store was built for {built_for.device} with offload_dir="
            f"{built_for.offload_dir!r}; a later strategy must use the same device and tier."
        )


def _resize_cache(store: HostStore, config: EngineConfig) -> None:
    if isinstance(store, DiskStore):
        store.resize_cache(config.cache_bytes)


def _release_training_state(weights: weakref.ref[StoredWeights]) -> None:
    """The engine's finalizer: holds its module's weights weakly, so that they are freed with the module
    in the same collection."""
    alive = weights()
    if alive is not None:
        alive.release_training_state()
