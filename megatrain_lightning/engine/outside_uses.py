"""Weights used outside the block that owns them, with autograd on: a penalty on the weights in
``training_step`` (L2 towards zero or towards the pretrained weights, EWC), a weight norm in the loss, a
training loop of the user's after ``fit`` that does the same.

Such an op computes on a copy read from the store (:mod:`.placeholders`), and autograd sums the weight's
gradient in the placeholder itself, as in a plain parameter. That sum joins the block's as one more
contribution of the pass (added as plain autograd adds a leaf's contributions: bitwise where there is one
such sum beside one use of the block), and leaves the device at once. The block's own contributions are
held as the pass's sum instead of being final at its last use, until the backward ends. So the block's
update runs once the backward is over (in the optimizer's ``step``, after its closure), and the op's
backward, which reads the weights again, reads the weights its forward read.

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
    "forward, or train on one device."
)
TOO_LATE = (
    "megatrain: a gradient of `{name}` from a use outside its layer reached it after the layer's update "
    "began: the use was made after the backward had passed the layer. Use weights outside their layers "
    "before the backward (in `training_step`)."
)


class OutsideUses:
    """The blocks whose weights were used outside them since the last backward ended, and the way of the
    gradients autograd sums for them into the block's sums."""

    def __init__(self, grads: HostGrads, data_parallel: bool) -> None:
        self.grads = grads
        self.data_parallel = data_parallel
        self.blocks: set[int] = set()  # their gradients are not final before the backward ends
        self._end_queued = False

    def begin_pass(self) -> None:
        self._end_queued = False  # a backward that failed never reached its end

    def note(self, block: int) -> None:
        """A use of ``block``'s weights outside it, autograd on: its gradient is final at the backward's end.
        Under data parallel nothing waits: a read alone is fine, a gradient an error (:meth:`arrived`)."""
        if not self.data_parallel:
            self.blocks.add(block)

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
        self.end_with_backward()

    def end_with_backward(self) -> None:
        """Make the blocks' sums final when the backward running now ends."""
        if not self._end_queued:
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._end_queued = False
        self.blocks.clear()
        self.grads.flush()  # every sum of this pass added to the block's: the backward is over
