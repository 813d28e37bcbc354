"""Global-norm clipping over the store's gradient sums, with exactly ``torch.nn.utils.clip_grad_norm_``'s
arithmetic: each gradient's 2-norm (``_foreach_norm`` over the whole tensor), then the norm of those.

Taken when clipping asks, the norms are a pass over every gradient after the backward, while the device
waits and the deferred updates cannot start. So when the trainer clips by norm (``early``), each block's
norms are taken as soon as its sums are final in the stepping backward (``block_final``: in the gradient
offload's worker on CUDA, while the device computes the next block) and the global norm is known the
moment the backward ends. Norms a block did not get early (its last backward never came: a forward no
loss used) are taken when asked, and a value clamp before the norm (``clip_grad_value_`` then
``clip_grad_norm_``) takes them all again after clamping.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatrain_lightning.engine.grads import HostGrads
from megatrain_lightning.store.host import HostStore

Key = tuple[int, int]  # (block, parameter index)


class GradNorms:
    """Per-parameter 2-norms of the gradient sums of one step."""

    def __init__(self, store: HostStore, grads: HostGrads) -> None:
        self.store = store
        self.grads = grads
        self.early = False  # take each block's norms once its sums are final in a stepping backward
        self._norms: dict[Key, Tensor] = {}

    def block_final(self, block: int) -> None:
        """``block``'s sums are final for this step (the backward's last use of it in a stepping pass)."""
        if self.early:
            self._norms.update(self._of_block(block, None))

    def total(self, order: list[Key], clamp: float | None) -> Tensor | None:
        """The global norm of every present gradient after clamping each to ``±clamp`` (if given; in the
        store), stacked in ``order`` (torch's: param groups, then parameters); ``None`` without gradients."""
        for key in self.grads.ready():  # user code changed `p.grad` after its norm was taken
            self._norms.pop(key, None)
        norms = {} if clamp is not None else self._norms
        present = set()  # a gradient user code set to None after its norm was taken counts no more
        for block in range(len(self.store.blocks)):
            keys = [(block, i) for i in self.grads.present(block)]
            present.update(keys)
            if clamp is not None or any(key not in norms for key in keys):
                norms.update(self._of_block(block, clamp))
        self.clear()
        stacked = [norms[key] for key in order if key in present]
        if not stacked:
            return None
        return torch.linalg.vector_norm(torch.stack(stacked), 2.0)

    def clear(self) -> None:
        self._norms = {}

    def _of_block(self, block: int, clamp: float | None) -> dict[Key, Tensor]:
        norms = {}
        for i in self.grads.present(block):  # one parameter at a time: torch's reduction over each gradient
            spec = self.store.blocks[block].params[i]
            span = (spec.offset, spec.offset + spec.numel)
            with self.store.pinned(block, "grad", write=clamp is not None, span=span) as grad:
                if clamp is not None:
                    clamp_([grad], clamp)
                (norms[block, i],) = torch._foreach_norm([grad], 2.0)
        return norms


def clamp_(grads: list[Tensor], value: float) -> None:
    """Clamp each gradient to ``[-value, value]`` in place (``clip_grad_value_``'s arithmetic)."""
    torch._foreach_clamp_min_(grads, -value)
    torch._foreach_clamp_max_(grads, value)
