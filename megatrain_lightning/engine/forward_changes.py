"""Layers that change their own weights in their forward, and what the engine does with the change.

``nn.Embedding(max_norm=...)`` renormalizes the rows it looks up, in place; a max-norm layer clamps its
weight. Where a block computes on a copy of its weights (a slot: every GPU run, the disk tier) such a
change would stay in the copy. The engine sees the slot's version counter move during a forward
(:func:`version_of`), and the store takes the changed fp32 weights once the slot is released, as a plain
model keeps them. Refused, each with what to do instead:

- a change of a bf16 copy: the fp32 weights it stands for cannot be known;
- a change the recompute in backward does not repeat exactly (``w.mul_(0.9)``, unlike a clamp or a
  renorm): its gradient would be of other weights than the forward used (the copy is put back first);
- data parallel: each rank would change its own copy by its own batch (DDP's replicas drift apart).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatrain_lightning.engine.blocks import CallSite
from megatrain_lightning.store.host import HostStore


def version_of(tensor: Tensor) -> int | None:
    """``tensor``'s version counter; ``None`` for a tensor made under ``torch.inference_mode`` (Lightning's
    evaluation), which has none."""
    return None if tensor.is_inference() else tensor._version


class ForwardChanges:
    """The blocks seen changing their weights in a forward, and the checks and write-backs around a run."""

    def __init__(self, store: HostStore, data_parallel: bool) -> None:
        self.store = store
        self.data_parallel = data_parallel
        self.blocks: set[int] = set()

    def before(self, site: CallSite, tensors: dict[int, Tensor], backward: bool) -> dict[int, Tensor] | None:
        """Before the recompute of a block that changes its weights: what they are, to compare after."""
        if not backward or site.block.index not in self.blocks:
            return None
        return {i: t.detach().clone() for i, t in tensors.items()}

    def after(
        self,
        site: CallSite,
        tensors: dict[int, Tensor],
        backward: bool,
        moved: bool,
        before: dict[int, Tensor] | None,
    ) -> dict[int, Tensor]:
        """After a run, the slot still held: the changed weights for :meth:`keep` (a forward's), none else."""
        if not moved:
            return {}
        if backward:
            if before is not None:
                self._check_repeated(site, tensors, before)
            return {}
        if self.data_parallel:
            raise RuntimeError(
                f"megatrain: `{site.name}` changes its weights in its forward (e.g. `nn.Embedding(max_norm="
                "...)`); under data parallel each rank would change its own copy by its own batch (as DDP's "
                "replicas would drift apart). Train it on one device, or without the change."
            )
        self.blocks.add(site.block.index)
        return {i: t.detach().to("cpu", copy=True) for i, t in tensors.items()}

    def keep(self, site: CallSite, values: dict[int, Tensor]) -> None:
        """The store takes the weights a forward changed (the slot released: its copy goes stale)."""
        block = site.block
        for index, value in values.items():
            spec = block.params[index]
            span = (spec.offset, spec.offset + spec.numel)
            weights = self.store.read_span(block.index, "param", span).view(spec.shape)
            if value.dtype == torch.float32 and not torch.equal(value, weights):
                self.store.write_span(block.index, "param", span, value)
            elif value.dtype != torch.float32 and not torch.equal(value, weights.to(value.dtype)):
                # Rewritten as they are: the changed copies (a slot, the host tier's bf16 shadow) go stale.
                self.store.write_span(block.index, "param", span, weights)
                raise RuntimeError(
                    f"megatrain: `{site.name}` changes its weights in its forward (e.g. "
                    "`nn.Embedding(max_norm=...)`), and computes on a bf16 copy of them: the change of its "
                    "fp32 weights cannot be known. Train it with `precision='32-true'`, or without the "
                    "change."
                )

    @staticmethod
    def _check_repeated(site: CallSite, tensors: dict[int, Tensor], before: dict[int, Tensor]) -> None:
        if all(torch.equal(t, before[i]) for i, t in tensors.items()):
            return  # the recompute repeated the change exactly (a clamp, a renorm)
        with torch.no_grad():
            for i, t in tensors.items():
                t.copy_(before[i])
        raise RuntimeError(
            f"megatrain: `{site.name}` changes its weights in its forward, and its recompute in backward "
            "changed them again (e.g. `w.mul_(0.9)`; a clamp or a renorm comes out the same): its gradient "
            "would be of other weights than the forward used. Train it with "
            "`MegaTrainStrategy(activation_checkpointing=False)`, or make the change come out the same."
        )
