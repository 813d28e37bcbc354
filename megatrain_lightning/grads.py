"""Gradient offload: each block's gradients leave the device as soon as they exist.

They are summed into fp32 host buffers in the store (kind ``"grad"``) in the order they
arrive, which is the order autograd would accumulate them into ``param.grad``: the sums are
bitwise those of plain PyTorch, across call sites of a tied block and across micro-batches.
On CUDA the copy runs on its own stream into a pinned staging buffer, and a worker thread adds
it into the accumulation buffer once the copy's event has completed.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from megatrain_lightning.stats import EngineStats
from megatrain_lightning.store import HostStore, aligned_empty


class HostGrads:
    def __init__(self, store: HostStore, device: torch.device, stats: EngineStats) -> None:
        self.store = store
        self.stats = stats
        self._present: list[set[int]] = [set() for _ in store.blocks]
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="megatrain-offload") if self._cuda else None
        self._staging: dict[torch.dtype, list[Tensor]] = {}
        self._last: Future | None = None

    def present(self, block: int) -> list[int]:
        """Indices of ``block``'s parameters that received a gradient since ``clear``."""
        return sorted(self._present[block])

    def offload(self, block: int, grads: dict[int, Tensor], then: Callable[[], None]) -> None:
        """Add ``grads`` (parameter index -> device gradient) to the host buffers, then call ``then``."""
        if not self._cuda:
            self._accumulate(block, grads)
            then()
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
        on_host = {i: staging[params[i].offset : params[i].offset + params[i].numel].view(params[i].shape) for i in grads}
        # ``grads`` stays referenced until the copy has completed, so the allocator cannot reuse it early.
        self._last = self._worker.submit(self._finish, block, grads, on_host, copied, staging, dtype, then)

    def flush(self) -> None:
        """Wait until every offload issued so far has been added to the host buffers."""
        if self._last is not None:
            self._last.result()

    def clear(self) -> None:
        self.flush()
        for present in self._present:
            present.clear()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    def _finish(self, block, grads, on_host, copied, staging, dtype, then) -> None:
        copied.synchronize()
        del grads
        self._accumulate(block, on_host)
        self._staging[dtype].append(staging)
        then()

    def _accumulate(self, block: int, grads: dict[int, Tensor]) -> None:
        dst = self.store.views("grad", block)
        present = self._present[block]
        for index, grad in grads.items():
            if index in present:
                dst[index].add_(grad)
            else:
                dst[index].copy_(grad)
                present.add(index)
            self.stats.d2h_bytes += grad.numel() * grad.element_size()

    def _take_staging(self, dtype: torch.dtype) -> Tensor:
        pool = self._staging.setdefault(dtype, [])
        if pool:
            return pool.pop()
        numel = max(b.numel for b in self.store.blocks)
        return aligned_empty(numel, dtype, self.store.pin_memory)
