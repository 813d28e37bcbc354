"""CPU AdamW of a data-parallel engine: each rank updates its shards (:mod:`..engine.distributed`).

The update itself is :class:`CPUAdamW`'s: it works chunk by chunk over the store's ``spans``, which for a
sharded store are the rank's own. What differs is when gradients are reduced and how clipping sees them:
gradients of the step's closure are reduce-scattered as they are offloaded (so updates still overlap the
backward), those summed locally before (accumulation micro-batches, a manual backward) once at the step,
and global-norm clipping adds the ranks' squared shard norms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatrain_lightning.engine.distributed import ShardedGrads
from megatrain_lightning.optim.adamw import CPUAdamW
from megatrain_lightning.optim.hparams import Clip


class ShardedCPUAdamW(CPUAdamW):
    """:class:`CPUAdamW` over a sharded store and :class:`ShardedGrads` (same arguments)."""

    grads: ShardedGrads

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        reducing, self.grads.reduce_at_once = self.grads.reduce_at_once, True
        try:
            if closure is None:
                self.grads.reduce_local()
                return super().step()

            def reduced_closure() -> Any:
                loss = closure()
                self.grads.reduce_local()  # blocks the closure's backward left without gradients
                return loss

            return super().step(reduced_closure)
        finally:
            self.grads.reduce_at_once = reducing

    def clip_grad_value_(self, clip_value: float) -> None:
        self.grads.reduce_local()
        super().clip_grad_value_(clip_value)

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Global-norm clipping over all ranks' shards (the norm in fp64, then torch's coefficient)."""
        self._check_can_clip()
        self.grads.reduce_local()
        squares = self.grads.squared_norm(self._clip.value)
        dist.all_reduce(squares, op=dist.ReduceOp.SUM)
        total = squares.sqrt().float()
        self._clip = Clip(coef=torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total


ShardedCPUAdamW.step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
