"""Zero-copy residency where the compute device is the host: blocks compute on the store's own weights.

With the CPU as the compute device, fp32 compute and the host tier, a device slot would be a second
copy of the store's fp32 buffer in the same RAM. :class:`HostViews` takes the :class:`~.pager.Pager`'s
place there: ``acquire`` hands out the block's flat master weights themselves, once any pending update
of the block is done (as a load would wait for it), so nothing is copied (``h2d_bytes`` stays 0) and
no slot memory exists. The store's version gate still holds: an update may start only once the block
is released (the engine submits it after the block's last use), and a block whose version moved on
while it was acquired raises at ``release``, as a slot does. Only the compute thread calls it.

In bf16 (``bf16-mixed``, ``bf16-true``) the host tier keeps a bf16 shadow of the weights a slot holds in
bf16, which the update rewrites with the weights; :class:`ShadowViews` binds those and the fp32 weights of
the rest in place, both from one buffer per block, so that every saved view of the block is of one storage,
as of a slot.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from megatrain_lightning.engine.slots import SlotLayout
from megatrain_lightning.engine.trace import Trace
from megatrain_lightning.store.host import HostStore
from megatrain_lightning.telemetry.stats import EngineStats


class HostViews:
    """The pager's interface over the store's buffers: ``acquire`` returns a block's weights as bytes."""

    num_slots = 0  # no slot memory: every block is resident in the store

    def __init__(self, store: HostStore, stats: EngineStats) -> None:
        self.store = store
        self.stats = stats
        self.trace = Trace()
        self._held: dict[int, tuple[int, int]] = {}  # block -> (pins, store version when first pinned)

    def begin_pass(self, kind: str) -> None:
        self.trace.begin_pass(kind)

    def acquire(self, block: int, backward: bool) -> Tensor:
        """``block``'s master weights (the store's flat buffer as bytes), pinned until ``release``."""
        start = time.perf_counter()
        self.trace.access((block, backward))
        weights = self._weights(block)
        pins, version = self._held.get(block, (0, self.store.version(block)))
        self._held[block] = (pins + 1, version)
        self.stats.add(fetch_wait_s=time.perf_counter() - start)
        return weights

    def _weights(self, block: int) -> Tensor:
        """``block``'s weights as bytes, once its pending update is done (the store's read waits for it)."""
        return self.store.read(block, "param").view(torch.uint8)

    def view(self, block: int, index: int, flat: Tensor) -> Tensor:
        """Parameter ``index`` of ``block`` in its acquired buffer, shaped."""
        spec = self.store.blocks[block].params[index]
        return flat.view(torch.float32)[spec.offset : spec.offset + spec.numel].view(spec.shape)

    def release(self, block: int) -> None:
        pins, version = self._held.pop(block)
        if pins > 1:
            self._held[block] = (pins - 1, version)
        if version != self.store.version(block):
            raise RuntimeError(f"megatrain: block {block} changed while in use on the device")

    def is_last_use(self, block: int) -> bool:
        return self.trace.is_last_use(block)

    def close(self) -> None:
        """Nothing to stop: no worker threads."""


class ShadowViews(HostViews):
    """bf16 compute on the CPU: a block computes on its weights' bf16 shadow (the weights a slot would hold
    in bf16, as the update wrote them) and on its fp32 weights for the rest, bound in place from the store's
    joint buffer (:meth:`~megatrain_lightning.store.host.HostStore.joined`): nothing is copied, and the
    values are those a slot would hold, so results are bitwise the slot path's."""

    def __init__(self, store: HostStore, stats: EngineStats, layout: SlotLayout) -> None:
        super().__init__(store, stats)
        self._starts = [  # per block and parameter, its first byte in the joint buffer
            [
                store.joint_offset(b.index, p.offset, dtype != torch.float32)
                for p, dtype in zip(b.params, layout.dtypes[b.index], strict=True)
            ]
            for b in store.blocks
        ]
        self.layout = layout

    def _weights(self, block: int) -> Tensor:
        return self.store.joined(block)  # after the pending update, the shadow current

    def view(self, block: int, index: int, joint: Tensor) -> Tensor:
        spec, dtype, start = (
            self.store.blocks[block].params[index],
            self.layout.dtypes[block][index],
            self._starts[block][index],
        )
        return joint[start : start + spec.numel * dtype.itemsize].view(dtype).view(spec.shape)
