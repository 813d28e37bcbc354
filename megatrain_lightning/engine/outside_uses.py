"""Weights used outside the block that owns them, with autograd on: a penalty on the weights in
``training_step`` (L2 towards zero or towards the pretrained weights, EWC), a weight norm in the loss, a
training loop of the user's after ``fit`` that does the same.

Such an op computes on a copy read from the store (:mod:`.placeholders`), and autograd sums the weight's
gradient in the placeholder itself, as in a plain parameter. That sum joins the block's as one more
contribution of the pass (added as plain autograd adds a leaf's contributions: bitwise where there is one
such sum beside one use of the block), and leaves the device at once. Where the backward running at the
block's last use will still reach such a placeholder, the block's own contributions are held as the pass's
sum instead of being final, until the backward ends. So the block's update runs once the backward is over
(in the optimizer's ``step``, after its closure), and the op's backward, which reads the weights again,
reads the weights its forward read. A use this backward does not reach (a weight norm a callback logged
after the last step) holds nothing back: the update overlaps the backward as without it.

Inside a block's call such a read is part of the block's graph, whose gradients megatrain takes for the
block's own weights only: the engine refuses it (:meth:`Engine.note_outside_use`). Under data parallel
each rank holds part of each block: a gradient that reaches a placeholder there is an error (a read alone,
a weight norm logged by a callback, is not).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatrain_lightning.engine.grads import HostGrads

DATA_PARALLEL = (
    "megatrain: `{name}` was used outside the layer that owns it with autograd on, and a gradient reached "
    "it; under data parallel each rank holds only part of it, so that gradient cannot be taken there. Use "
    "the optimizer's `weight_decay` for an L2 penalty towards zero, compute the term inside the layer's "
    "forward, or train on one device. (Under `bf16-mixed` a call of the model outside autocast computes "
    "with its weights this way: call it inside `torch.autocast`.)"
)
TOO_LATE = (
    "megatrain: a gradient of `{name}` from a use outside its layer reached it after the layer's update "
    "began: the use was made after the backward had passed the layer. Use weights outside their layers "
    "before the backward (in `training_step`)."
)


class OutsideUses:
    """The placeholders used outside their blocks since the last backward ended, and the way of the
    gradients autograd sums in them into the block's sums."""

    def __init__(self, grads: HostGrads, data_parallel: bool) -> None:
        self.grads = grads
        self.data_parallel = data_parallel
        self.used: dict[int, dict[int, Tensor]] = {}  # block -> index -> placeholder
        self._summed: set[tuple[int, int]] = set()  # (block, index) whose gradient this backward summed
        self._end_queued = False

    def begin_pass(self) -> None:
        self._end_queued = False  # a backward that failed never reached its end
        self._summed.clear()

    def note(self, placeholder: Tensor) -> None:
        """A use of ``placeholder`` outside its block, autograd on. Under data parallel nothing waits: a read
        alone is fine, a gradient an error (:meth:`arrived`)."""
        if not self.data_parallel:
            self.used.setdefault(placeholder._block, {})[placeholder._index] = placeholder

    def awaited(self, block: int) -> bool:
        """Whether the backward running now will still bring ``block`` a gradient from a use outside it, so
        that its sum is final only when the backward ends. A gradient already summed is in (an L2 penalty
        added to the loss after the forward: autograd runs its nodes first). Asked at each of the block's
        backwards while there were uses: it queues that end."""
        self.end_with_backward()
        return any(
            reached_by_this_backward(p) and (block, index) not in self._summed
            for index, p in self.used.get(block, {}).items()
        )

    def arrived(self, placeholder: Tensor, updating: bool) -> None:
        """Autograd summed this backward's gradient of ``placeholder`` (its post-accumulate hook): it joins
        the block's sum of this pass now, and leaves the device; the sums are final when the backward ends.
        ``updating``: the block's update has begun."""
        if self.data_parallel or updating:
            raise RuntimeError(
                (DATA_PARALLEL if self.data_parallel else TOO_LATE).format(name=placeholder._name)
            )
        grad = torch._C.TensorBase.grad.__get__(placeholder)
        torch._C.TensorBase.grad.__set__(placeholder, None)
        if grad is not None:
            self.grads.offload(placeholder._block, {placeholder._index: grad}, final=False, then=lambda: None)
        self._summed.add((placeholder._block, placeholder._index))  # autograd sums a leaf's once a backward
        self.end_with_backward()

    def end_with_backward(self) -> None:
        """Make the blocks' sums final when the backward running now ends."""
        if not self._end_queued:
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._end_queued = False
        self.used.clear()
        self._summed.clear()
        self.grads.flush()  # every sum of this pass added to the block's: the backward is over


def reached_by_this_backward(placeholder: Tensor) -> bool:
    """Whether the backward running now accumulates a gradient in ``placeholder``: its gradient accumulator
    (autograd's, shared by every graph that holds it) is a node this backward executes. A placeholder frozen
    since its use has none."""
    if not placeholder.requires_grad:
        return False
    try:
        return torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(placeholder).node)
    except RuntimeError:  # `torch.autograd.grad` (or `backward(inputs=...)`): it may not be asked about
        return True  # leaves; wait for the backward's end, as when one is reached
