"""Gradient offload: each block's gradients leave the device as soon as they exist.

They are summed into fp32 host buffers in the store (kind ``"grad"``) exactly as autograd
sums them into ``param.grad``: within one backward pass, the contributions of a block's several
uses (GPT-2's tied embedding and head) are added together first (kind ``"grad_pass"``), and that
sum is then added to what earlier micro-batches left. The results are bitwise plain PyTorch's.
On CUDA the copy runs on its own stream into a pinned staging buffer, and a worker thread adds
it into the accumulation buffer once the copy's event has completed.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from megatrain_lightning.futures import fresh_copy
from megatrain_lightning.stats import EngineStats
from megatrain_lightning.store import HostStore, aligned_empty
from megatrain_lightning.timeline import TIMELINE


class HostGrads:
    """Host fp32 gradient accumulation. ``asynchronous`` (default: on CUDA) hands each offload to one worker
    thread; on the CPU the gradients are already on the host and that worker only adds them (a mode for
    tests of the asynchronous path). Only the compute thread calls ``offload``, ``flush`` and ``clear``."""

    def __init__(
        self, store: HostStore, device: torch.device, stats: EngineStats, asynchronous: bool | None = None
    ) -> None:
        self.store = store
        self.stats = stats
        self._present: list[set[int]] = [set() for _ in store.blocks]
        cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if cuda else None
        asynchronous = cuda if asynchronous is None else asynchronous
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="megatrain-offload") if asynchronous else None
        self._staging: dict[torch.dtype, list[Tensor]] = {}
        self._pending: list[Future] = []  # every offload since the last flush, in order
        self._pass_sums: dict[int, set[int]] = {}  # block -> indices summed in "grad_pass" this pass

    def present(self, block: int) -> list[int]:
        """Indices of ``block``'s parameters that received a gradient since ``clear``."""
        return sorted(self._present[block])

    def offload(self, block: int, grads: dict[int, Tensor], final: bool, then: Callable[[], None]) -> None:
        """Add ``grads`` (parameter index -> device gradient) to the host buffers, then call ``then``.

        ``final``: no further use of ``block`` in this backward pass will contribute gradients.
        """
        if self._worker is None:
            self._accumulate(block, grads, final)
            then()
            return
        if self._stream is None:  # already on the host: nothing to copy
            self._pending.append(self._worker.submit(self._finish, block, grads, final, then))
            return
        dtype = next(iter(grads.values())).dtype
        staging = self._take_staging(dtype)
        params = self.store.blocks[block].params
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for index, grad in grads.items():
                p = params[index]
                staging[p.offset : p.offset + p.numel].view(p.shape).copy_(grad, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        on_host = {
            i: staging[params[i].offset : params[i].offset + params[i].numel].view(params[i].shape)
            for i in grads
        }
        # ``grads`` stays referenced until the copy has completed, so the allocator cannot reuse it early.
        self._pending.append(
            self._worker.submit(self._finish, block, on_host, final, then, (copied, grads, staging))
        )

    def flush(self) -> None:
        """Wait until every offload issued so far has been added to the accumulation buffers; raise the
        first that failed (the sums are then incomplete: nothing may be updated from them)."""
        pending, self._pending = self._pending, []
        failures = [failure for failure in (future.exception() for future in pending) if failure is not None]
        if failures:
            self._pass_sums.clear()
            raise fresh_copy(failures[0]) from failures[0]
        for block in list(self._pass_sums):
            self._fold(block)

    def clear(self) -> None:
        try:
            self.flush()
        finally:
            for present in self._present:
                present.clear()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    def _finish(
        self,
        block: int,
        on_host: dict[int, Tensor],
        final: bool,
        then: Callable[[], None],
        copy: tuple[torch.cuda.Event, dict[int, Tensor], Tensor] | None = None,
    ) -> None:
        """In the worker: once the device-to-host copy (if any) is done, add the gradients, then ``then``."""
        if copy is not None:
            copied, _, staging = copy  # the device gradients, held until this call returns
            copied.synchronize()
        try:
            self._accumulate(block, on_host, final)
        finally:
            if copy is not None:
                self._staging[staging.dtype].append(staging)
        then()

    def _accumulate(self, block: int, grads: dict[int, Tensor], final: bool) -> None:
        with TIMELINE.span("offload"):
            self._accumulate_now(block, grads, final)

    def _accumulate_now(self, block: int, grads: dict[int, Tensor], final: bool) -> None:
        for grad in grads.values():
            self.stats.d2h_bytes += grad.numel() * grad.element_size()
        if block not in self._pass_sums and final:
            self._add(block, "grad", self._present[block], grads)
            return
        self._add(block, "grad_pass", self._pass_sums.setdefault(block, set()), grads)
        if final:
            self._fold(block)

    def _fold(self, block: int) -> None:
        """Add this pass's summed contributions of ``block`` to the accumulation buffer."""
        with self.store.pinned(block, "grad_pass") as flat:
            sums = self.store.blocks[block].views(flat)
            self._add(block, "grad", self._present[block], {i: sums[i] for i in self._pass_sums.pop(block)})
        self.store.discard(block, "grad_pass")

    def _add(self, block: int, kind: str, present: set[int], grads: dict[int, Tensor]) -> None:
        with self.store.pinned(block, kind, write=True) as flat:
            self._add_into(self.store.blocks[block].views(flat), present, grads)

    @staticmethod
    def _add_into(dst: list[Tensor], present: set[int], grads: dict[int, Tensor]) -> None:
        for index, grad in grads.items():
            if index in present:
                dst[index].add_(grad)
            else:
                dst[index].copy_(grad)
                present.add(index)

    def _take_staging(self, dtype: torch.dtype) -> Tensor:
        pool = self._staging.setdefault(dtype, [])
        if pool:
            return pool.pop()
        numel = max(b.numel for b in self.store.blocks)
        return aligned_empty(numel, dtype, self.store.pin_memory)
