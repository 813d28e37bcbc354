"""One call of a paged block as an autograd function: the block resident for its forward, fetched again
for its backward.

:class:`PagedCall`'s forward runs the block with its weights bound to a device slot and keeps only
its inputs (activation checkpointing) or its graph with every saved slot view replaced by a
reference (saved-graph replay). Its backward makes the block resident again, recomputes it under
:mod:`.recompute`'s rule or replays the graph rebound to the new slot, computes the gradients of
the block's parameters and inputs, and hands the parameter gradients to the engine's offload.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from megatrain_lightning.engine.blocks import CallSite
from megatrain_lightning.engine.captures import Captures
from megatrain_lightning.engine.placeholders import ParamPlaceholder
from megatrain_lightning.engine.recompute import (
    ESCAPED,
    ForwardState,
    FreshCache,
    cache_length,
    discarding_saved_tensors,
    is_cache,
    noting_changed_buffers,
)
from megatrain_lightning.engine.shared_inputs import carried_sums, hand_on, uses_in
from megatrain_lightning.telemetry.timeline import TIMELINE

if TYPE_CHECKING:
    from megatrain_lightning.engine.runtime import Engine


@dataclass(eq=False)
class Call:
    """One call of a call site: the non-tensor arguments, and afterwards the non-tensor outputs."""

    block: str  # the name of the block whose call this is
    forward: Callable
    flat: list[Any]
    spec: Any
    positions: list[int]
    out_flat: list[Any] = field(default_factory=list)
    out_spec: Any = None
    out_positions: list[int] = field(default_factory=list)
    captures: Captures = field(default_factory=Captures)
    views: dict[int, Tensor] = field(default_factory=dict)  # the last run's inputs read through a view

    def run(self, tensors: tuple[Tensor, ...] | list[Tensor], recompute: bool = False) -> list[Tensor]:
        """The block's output tensors, then the tensors its layers handed to the model's collector."""
        caches = {i: leaf.copy() for i, leaf in enumerate(self.flat) if isinstance(leaf, FreshCache)}
        flat = [caches.get(i, leaf) for i, leaf in enumerate(self.flat)]
        self.views = {}
        for position, (i, t) in enumerate(zip(self.positions, tensors, strict=True)):
            flat[i] = _as_non_leaf(t)
            if flat[i] is not t:
                self.views[position] = flat[i]
        args, kwargs = tree_unflatten(flat, self.spec)
        with self.captures.watching(recompute) as captured:
            out_flat, self.out_spec = tree_flatten(self.forward(*args, **kwargs))
        if not recompute:
            for i, cache in caches.items():
                self.flat[i].note_forward_run(self.block, cache)
        self.out_positions = [i for i, leaf in enumerate(out_flat) if isinstance(leaf, Tensor)]
        self.out_flat = [None if i in self.out_positions else leaf for i, leaf in enumerate(out_flat)]
        return [out_flat[i] for i in self.out_positions] + captured

    def rebuild_outputs(self, tensors: tuple[Tensor, ...]) -> Any:
        """The block's outputs as it returned them; the captured tensors go to the model's collector."""
        flat = list(self.out_flat)
        count = len(self.out_positions)
        for i, t in zip(self.out_positions, tensors[:count], strict=True):
            flat[i] = t
        self.captures.hand_over(tensors[count:])
        return tree_unflatten(flat, self.out_spec)


def _as_non_leaf(t: Tensor) -> Tensor:
    """The block's input as the block sees it. Our inputs are leaves (detached from the previous block), and
    autocast casts a leaf that requires grad once and reuses the cast (as it does for weights), so several
    consumers' gradients would be summed in bf16 before the cast's backward; under plain PyTorch the input
    is the previous block's output, cast anew at each use, its gradients summed in fp32. A view is cast
    anew too."""
    if t.is_leaf and t.requires_grad and torch.is_autocast_enabled(t.device.type):
        return t.view_as(t)
    return t


def off_slot(value: Any, slot: Tensor) -> Any:
    """``value`` with every tensor that is a view of the slot (a block returning one of its weights)
    copied: once the block is released, the slot holds another block's weights."""
    storage = slot.untyped_storage().data_ptr()

    def own(t: Any) -> Any:
        return t.clone() if isinstance(t, Tensor) and t.untyped_storage().data_ptr() == storage else t

    return tree_map(own, value)


def _detached(tensors: tuple[Tensor, ...] | list[Tensor]) -> list[Tensor]:
    """The call's inputs as leaves of its graph; a weight given as an argument as its values in the store."""
    return [_values(t).detach().requires_grad_(t.requires_grad) for t in tensors]


def _values(tensor: Tensor) -> Tensor:
    return tensor.materialize() if isinstance(tensor, ParamPlaceholder) else tensor


def reaches_another_block(outputs: list[Tensor], own: list[Tensor]) -> bool:
    """Whether the graph of a call's ``outputs`` reaches a tensor that requires grad other than the call's
    inputs and weights (``own``): one that another block made and handed over outside the call's
    arguments, e.g. keys and values that a layer reads from another layer through the cache. Backward
    asks autograd for the gradients of ``own`` only, so that tensor's gradient would be lost."""
    allowed = {id(t) for t in own}
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # AccumulateGrad: a leaf that requires grad
        if leaf is not None:
            if id(leaf) not in allowed:
                return True
            continue
        stack.extend(fn for fn, _ in node.next_functions)
    return False


def check_graph(
    site: CallSite, call: Call, outputs: list[Tensor], inputs: list[Tensor], leaves: dict[int, Tensor]
) -> None:
    """Refuse a block that computes with another block's tensors (``reaches_another_block``), on the first
    call that builds a graph, and on a call attending over a cache an earlier forward filled
    (:func:`_continues_a_cache`): its gradients would be wrong, not slow."""
    continues = _continues_a_cache(site, call)
    if (site.graph_checked and not continues) or not any(o.grad_fn is not None for o in outputs):
        return
    site.graph_checked = True
    if not reaches_another_block(outputs, inputs + list(leaves.values())):
        return
    if continues:
        raise MisconfigurationException(
            f"megatrain: the block `{site.name}` attends over a key/value cache whose keys and values an "
            "earlier forward computed with gradients (a prompt encoded for its continuation), or an earlier "
            "run of the same layer in this forward (a layer listed twice in the model's layers). megatrain "
            "routes gradients through block arguments and outputs only, so theirs would be lost. Encode the "
            "prompt under `torch.no_grad()` (its keys then take no gradient), give the whole sequence to "
            "one forward, or pass `use_cache=False` where a layer runs twice."
        )
    raise MisconfigurationException(
        f"megatrain: the block `{site.name}` computes with a tensor that another block made and that is "
        "not one of its arguments (e.g. keys and values shared across layers through the cache: "
        "`kv_source_layers`, `num_kv_shared_layers`). megatrain pages one block at a time and routes "
        "gradients through block arguments and outputs only, so that tensor's gradient would be "
        "lost. Train such a model with a config that shares no tensors across layers, or "
        "without megatrain."
    )


def _continues_a_cache(site: CallSite, call: Call) -> bool:
    """Whether ``call`` attends over a key/value cache holding positions that ``site`` was given before: a
    continuation's forward after its prompt's (a forward makes its cache anew, its layers append to it)."""
    caches = [value for value in call.flat if is_cache(value)]
    again = any(cache in site.caches and cache_length(cache) for cache in caches)
    site.caches.update(caches)
    return again


CHANGED_SINCE_FORWARD = (
    "megatrain: a weight of `{block}` was changed in place between its forward and the backward that "
    "needs it. megatrain fetches the block's weights again for its backward, so it would take the "
    "gradients of other weights than the forward used (PyTorch refuses this too for every weight its "
    "backward saved: 'a variable needed for gradient computation has been modified by an inplace "
    "operation'). Change weights before the forward or after the optimizer step (e.g. in "
    "`on_train_batch_end`)."
)


@dataclass(frozen=True)
class _SlotRef:
    """A saved tensor that was a view of the block's slot: rebuilt from whichever slot holds it later."""

    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


class PagedCall(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, engine: Engine, site: CallSite, call: Call, anchor: Tensor, *tensors: Tensor
    ) -> Any:
        ctx.engine, ctx.site, ctx.call = engine, site, call
        ctx.user_writes = engine.weights.user_writes[site.block.index]
        engine.backwards.forward(site.block.index)
        if engine.config.activation_checkpointing:
            ctx.forward_state = ForwardState.capture(engine.config.device, site.module)
            with (
                engine.resident(site, backward=False, grad=True) as (slot, leaves),
                torch.enable_grad(),
                discarding_saved_tensors(),
                noting_changed_buffers(site.module, ctx.forward_state),
                TIMELINE.span("compute"),
            ):
                inputs = _detached(tensors)
                outputs = off_slot(call.run(inputs), slot)
            ctx.save_for_backward(*tensors)
        else:
            with engine.resident(site, backward=False, grad=True) as (slot, leaves):
                inputs = _detached(tensors)
                slot_storage = slot.untyped_storage().data_ptr()
                # unpack reads the slot through a holder, not ctx: ctx -> graph -> hook -> ctx would be a
                # cycle through C++ that the garbage collector cannot see (a forward without backward leaked).
                holder: list[Tensor] = []
                ctx.slot_holder = holder

                def pack(t: Tensor) -> Any:
                    if t.device == slot.device and t.untyped_storage().data_ptr() == slot_storage:
                        return _SlotRef(t.size(), t.stride(), t.storage_offset(), t.dtype)
                    return t

                def unpack(saved: Any) -> Tensor:
                    if isinstance(saved, _SlotRef):
                        if not holder:  # backward through the graph, but not through this call's
                            raise RuntimeError(ESCAPED)
                        # The slot is a byte buffer; the offset counts elements of the saved dtype.
                        slot = holder[0].view(saved.dtype)
                        return slot.as_strided(saved.size, saved.stride, saved.offset)
                    return saved

                with (
                    torch.enable_grad(),
                    torch.autograd.graph.saved_tensors_hooks(pack, unpack),
                    TIMELINE.span("compute"),
                ):
                    outputs = off_slot(call.run(inputs), slot)
            ctx.graph = (outputs, inputs, leaves)
        check_graph(site, call, outputs, inputs, leaves)
        ctx.takers = engine.shared_inputs.note(ctx, tensors, uses_in(outputs, inputs, call.views))
        returned = tuple(o.detach() for o in outputs)
        # An output computed from nothing that takes a gradient (T5's cross-attention bias, a mask) takes none
        # either, as in plain PyTorch (kernels choose by it: CPU attention with a bias that requires grad).
        ctx.mark_non_differentiable(
            *[r for r, o in zip(returned, outputs, strict=True) if not o.requires_grad]
        )
        ctx.set_materialize_grads(False)
        return returned

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor | None) -> Any:
        engine: Engine = ctx.engine
        site, call = ctx.site, ctx.call
        block = site.block.index
        if engine.weights.user_writes[block] != ctx.user_writes:
            raise RuntimeError(CHANGED_SINCE_FORWARD.format(block=site.block.name))
        checkpointed = engine.config.activation_checkpointing
        if not checkpointed and not hasattr(ctx, "graph"):
            raise RuntimeError(
                f"megatrain: a second backward through `{site.block.name}` (`retain_graph=True`) needs "
                "`MegaTrainStrategy(activation_checkpointing=True)` (the default): without it each block's "
                "graph is freed by its first backward, to free its activations at once."
            )
        with (
            engine.resident(site, backward=True, grad=checkpointed) as (slot, bound),
            TIMELINE.span("compute"),
        ):
            last_use = engine.backwards.backward(block) or engine.pager.is_last_use(block)
            if checkpointed:
                inputs = _detached(ctx.saved_tensors)
                leaves = bound
                with torch.enable_grad(), ctx.forward_state.restored():
                    outputs = call.run(inputs, recompute=True)
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
            pairs += carried_sums(ctx, ctx.takers, inputs, call.views)  # autograd runs these roots first
            if pairs and wrt:
                grads = torch.autograd.grad(
                    [o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True
                )
            else:
                grads = (None,) * len(wrt)
        if not checkpointed:  # a later unpack of this graph (a tensor that left the block) finds no slot
            del ctx.graph
            ctx.slot_holder.clear()
        engine.offload(site, wrt_leaves, list(grads[len(wrt_inputs) :]), last_use)
        input_grads = iter(grads[: len(wrt_inputs)])
        returned = [next(input_grads) if t.requires_grad else None for t in inputs]
        hand_on(ctx, ctx.takers, returned)
        return (None, None, None, None, *returned)
