"""Gradient offload: each block's gradients leave the device as soon as they exist.

They are summed into fp32 host buffers in the store (kind ``"grad"``) exactly as autograd
sums them into ``param.grad``: within one backward pass, the contributions of a block's several
uses (GPT-2's tied embedding and head) are added together first (kind ``"grad_pass"``), and that
sum is then added to what earlier micro-batches left. The results are bitwise plain PyTorch's, but
for a block called several times in one pass whose call also uses a weight several times (``x @ w``
and ``x @ w.t()``): autograd adds those contributions one by one, across calls, megatrain adds each
call's sum; the same fp32 additions in another order, within a rounding.
On CUDA the copy runs on its own stream into a pinned staging buffer, and a worker thread adds
it into the accumulation buffer once the copy's event has completed. At most ``max_in_flight``
offloads are between their copy and the end of their host add, each in its own staging buffer:
when the host add falls behind, the backward pass waits instead of piling up staging buffers and
device gradients (the caching allocator frees those once the copy has read them: ``record_stream``).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future

import torch
from torch import Tensor

from megatrain_lightning.engine.chaos import point
from megatrain_lightning.engine.futures import fresh_copy
from megatrain_lightning.engine.threads import bulk_threads, worker_pool
from megatrain_lightning.engine.user_grads import HandedGrads
from megatrain_lightning.store.host import HostStore
from megatrain_lightning.store.memory import host_empty
from megatrain_lightning.store.sizing import STAGING_BUFFERS
from megatrain_lightning.telemetry.stats import EngineStats
from megatrain_lightning.telemetry.timeline import TIMELINE

NOT_CLEARED = (
    "megatrain: a backward adds to gradients that an optimizer step already used and nothing cleared since: "
    "PyTorch would add to the last step's gradients, which megatrain drops once its update used them. Call "
    "`optimizer.zero_grad()` (or `module.zero_grad()`) after `optimizer.step()`."
)


class HostGrads:
    """Host fp32 gradient accumulation. ``asynchronous`` (default: on CUDA) hands each offload to one
    worker thread; on the CPU the compute thread copies the gradients into a staging buffer and that
    worker only adds them (a mode for tests of the asynchronous path). ``offload``, ``flush`` and
    ``clear`` are never called at once: the backward pass (in autograd's thread for the device) and the
    training loop take turns."""

    def __init__(
        self,
        store: HostStore,
        device: torch.device,
        stats: EngineStats,
        asynchronous: bool | None = None,
        max_in_flight: int = STAGING_BUFFERS,
    ) -> None:
        self.store = store
        self.stats = stats
        self.device = device
        self._present: list[set[int]] = [set() for _ in store.blocks]
        self._consumed: dict[int, set[int]] = {}  # block -> the indices whose sums its update used
        cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if cuda else None
        asynchronous = cuda if asynchronous is None else asynchronous
        self._worker = worker_pool(1, "megatrain-offload", bulk_threads(device, 1)) if asynchronous else None
        # One permit per staging buffer: taken before the copy, given back after the host add.
        self.max_in_flight = max_in_flight
        self._room = threading.BoundedSemaphore(max_in_flight)
        self._staging: list[Tensor] = []  # free byte buffers (at most max_in_flight)
        self.staging_bytes = 0  # allocated so far (page-locked on CUDA)
        self._pending: list[Future] = []  # every offload since the last flush, in order
        self._pass_sums: dict[int, set[int]] = {}  # block -> indices summed in "grad_pass" this pass
        self._handed = HandedGrads()  # the `p.grad` copies user code holds (see `user_grad`)

    def mark_consumed(self, block: int) -> None:
        """``block``'s update has used its gradient sums, and the store has dropped them: its next backward
        starts new sums, as after ``zero_grad`` (which users call after a step; never adding to a buffer the
        pool has given another block since). In the update's thread: the sets are replaced, not changed."""
        self._consumed[block], self._present[block] = self._present[block], set()

    def read(self, block: int, index: int) -> Tensor | None:
        """A copy of one parameter's gradient summed since ``clear``; ``None`` if it has none, or once its
        update used it (never zeros for a sum that is gone). Waits for the block's pending update, if one
        was submitted: whether the sums are gone then follows the program, not timing (under data
        parallel the read is collective, and every rank must make the same choice)."""
        self.flush()
        self.store.wait_for_change(block)
        if index in self._consumed.get(block, ()):
            warnings.warn(
                "megatrain: a block's gradient is dropped once its update used it (its buffer serves the "
                "next block), so `p.grad` is None after the update; read gradients in `on_after_backward` or "
                "`on_before_optimizer_step` (updates wait for those hooks).",
                stacklevel=4,
            )
            return None
        if index not in self._present[block]:
            return None
        spec = self.store.blocks[block].params[index]
        return self.store.read_span(block, "grad", (spec.offset, spec.offset + spec.numel)).view(spec.shape)

    def user_grad(self, block: int, index: int, device: torch.device, dtype: torch.dtype) -> Tensor | None:
        """``p.grad`` for user code: a copy of the sum on ``device`` (:mod:`.user_grads`), the same tensor at
        each read while user code holds it; what user code changes in it or assigns reaches the sums before
        they are used (:meth:`write_back`)."""
        key = (block, index)
        held = self._handed.held(key)
        if held is not None:
            return held
        self._write(self._handed.take_let_go())  # a copy changed and let go: the new copy includes it
        grad = self.read(block, index)
        return None if grad is None else self._handed.hand_out(key, grad.to(device, dtype))

    def assign(self, block: int, index: int, value: Tensor | None) -> None:
        """``p.grad = value``: the parameter's sum is ``value`` from now on (``None``, as ``Module.zero_grad``
        sets: it has none, and the update skips it as AdamW skips a parameter without gradient)."""
        self.flush()
        self.store.wait_for_change(block)
        self._write(self._handed.take_let_go())
        self._handed.assign((block, index), value)
        self._consumed.get(block, set()).discard(index)  # cleared (or set) after the update used it
        if value is None:
            self._present[block].discard(index)
        else:
            self._present[block].add(index)

    def ready(self) -> list[tuple[int, int]]:
        """Make the sums what the step must use: every offload added, what user code did to ``p.grad``
        written back (returns those parameters). Called before the sums are used: the norms, the step."""
        self.flush()
        return self.write_back()

    def write_back(self) -> list[tuple[int, int]]:
        """Write what user code changed in or assigned to ``p.grad`` into the sums, and forget what was
        handed out; returns the parameters written (an offload's adds come after it: :meth:`ready`)."""
        edits = self._handed.take_all()
        self._write(edits)
        return [key for key, _ in edits]

    def _write(self, edits: list[tuple[tuple[int, int], Tensor]]) -> None:
        for (block, index), grad in edits:  # copied over the sum, as nothing is present
            self._add(block, "grad", set(), {index: grad.detach().to("cpu", torch.float32)})

    def present(self, block: int) -> list[int]:
        """Indices of ``block``'s parameters that received a gradient since ``clear``."""
        return sorted(self._present[block])

    def offload(self, block: int, grads: dict[int, Tensor], final: bool, then: Callable[[], None]) -> None:
        """Add ``grads`` (parameter index -> device gradient) to the host buffers, then call ``then``.

        ``final``: no further use of ``block`` in this backward pass will contribute gradients.
        """
        if self._consumed.get(block):
            raise RuntimeError(NOT_CLEARED)
        self._consumed.pop(block, None)
        if self._handed:  # what user code did to `p.grad` since the last backward comes first
            self.write_back()
        if self._worker is None:
            self._accumulate(block, grads, final)
            then()
            return
        start = time.perf_counter()
        self._room.acquire()  # back-pressure: waits while max_in_flight host adds are behind
        self.stats.add(offload_wait_s=time.perf_counter() - start)
        try:
            staging = self._take_staging()
        except BaseException:
            self._room.release()
            raise
        try:
            on_host, copied, late = self._copy_out(block, grads, staging)
            self._pending.append(
                self._worker.submit(self._finish, block, on_host, final, then, staging, copied, late)
            )
        except BaseException:
            self._give_back(staging)
            raise

    def _copy_out(
        self, block: int, grads: dict[int, Tensor], staging: Tensor
    ) -> tuple[dict[int, Tensor], torch.cuda.Event | None, dict[int, Tensor] | None]:
        """Copy ``grads`` into ``staging`` (on CUDA: queued on the offload stream, with the event the worker
        waits for); return the host views by parameter index, the event and the gradients left for the
        worker to copy. Each gradient keeps its dtype (fp32 or the compute dtype, as its slot parameter), at
        its parameter's fp32 place in the staging bytes."""
        params = self.store.blocks[block].params
        on_host = {}
        for i, grad in grads.items():
            start = params[i].offset * 4
            on_host[i] = staging[start : start + grad.nbytes].view(grad.dtype).view(params[i].shape)
        if self._worker_copies(staging):
            # Page-locking failed: a copy into pageable memory returns only once done, so this thread would
            # wait for the device. The worker copies once the gradients exist, holding them until then.
            computed = None
            if self._stream is not None:
                computed = torch.cuda.Event(blocking=True)
                computed.record(torch.cuda.current_stream(self.device))
            return on_host, computed, dict(grads)
        if self._stream is None:
            for index, grad in grads.items():
                on_host[index].copy_(grad)
            return on_host, None, None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for index, grad in grads.items():
                on_host[index].copy_(grad, non_blocking=True)
                # The allocator reuses this gradient's memory only after the copy has read it, so no
                # reference has to outlive this call.
                grad.record_stream(self._stream)
            copied = torch.cuda.Event(blocking=True)  # the worker sleeps on it instead of spinning
            copied.record(self._stream)
        return on_host, copied, None

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
            self._consumed.clear()
            self._handed.clear()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    def _worker_copies(self, staging: Tensor) -> bool:
        """Whether the worker, not the compute thread, copies into ``staging``: on CUDA if it is pageable."""
        return self._stream is not None and not staging.is_pinned()

    def _finish(
        self,
        block: int,
        on_host: dict[int, Tensor],
        final: bool,
        then: Callable[[], None],
        staging: Tensor,
        copied: torch.cuda.Event | None,
        late: dict[int, Tensor] | None,
    ) -> None:
        """In the worker: once the device-to-host copy (if any) is done, or ``late`` is copied, add the
        gradients, then ``then``."""
        try:
            if copied is not None:
                copied.synchronize()
            if late is not None:
                with torch.cuda.stream(self._stream):  # no stream on the CPU: a no-op
                    for index, grad in late.items():
                        on_host[index].copy_(grad)
                late.clear()  # the device memory goes back to the allocator now
            self._accumulate(block, on_host, final)
        finally:
            self._give_back(staging)
        then()

    def _give_back(self, staging: Tensor) -> None:
        self._staging.append(staging)
        self._room.release()

    def _accumulate(self, block: int, grads: dict[int, Tensor], final: bool) -> None:
        point("grads.add.before")
        with TIMELINE.span("offload"):
            self._accumulate_now(block, grads, final)
        point("grads.add.after")

    def _accumulate_now(self, block: int, grads: dict[int, Tensor], final: bool) -> None:
        for grad in grads.values():
            self.stats.add(d2h_bytes=grad.numel() * grad.element_size())
        if block not in self._pass_sums and final:
            self._add(block, "grad", self._present[block], grads)
            return
        self._add(block, "grad_pass", self._pass_sums.setdefault(block, set()), grads)
        if final:
            self._fold(block)

    def _fold(self, block: int) -> None:
        """Add this pass's summed contributions of ``block`` to the accumulation buffer."""
        indices = self._pass_sums.pop(block)
        for span in self.store.spans(block):
            lo = span[0]
            with self.store.pinned_all(block, ("grad_pass", "grad"), write=True, span=span) as flats:
                for index, a, b, _ in self._parts(block, span, indices):
                    src = flats["grad_pass"][a - lo : b - lo]
                    self._add_into(flats["grad"][a - lo : b - lo], src, index in self._present[block])
        self._present[block].update(indices)
        self.store.discard(block, "grad_pass")

    def _add(self, block: int, kind: str, present: set[int], grads: dict[int, Tensor]) -> None:
        """One store chunk at a time, each gradient's part in it (elementwise: bitwise the whole sum)."""
        flat_grads = {index: grad.reshape(-1) for index, grad in grads.items()}
        for span in self.store.spans(block):
            lo = span[0]
            with self.store.pinned(block, kind, write=True, span=span) as flat:
                for index, a, b, start in self._parts(block, span, grads):
                    src = flat_grads[index][a - start : b - start]
                    self._add_into(flat[a - lo : b - lo], src, index in present)
        present.update(grads)

    def _parts(
        self, block: int, span: tuple[int, int], indices: Iterable[int]
    ) -> Iterator[tuple[int, int, int, int]]:
        """``(index, a, b, offset)`` per parameter of ``indices`` that overlaps the chunk ``span``: the
        overlap ``[a, b)`` in block elements, and where the parameter starts."""
        lo, hi = span
        params = self.store.blocks[block].params
        for index in indices:
            start = params[index].offset
            a, b = max(start, lo), min(start + params[index].numel, hi)
            if a < b:
                yield index, a, b, start

    @staticmethod
    def _add_into(dst: Tensor, src: Tensor, present: bool) -> None:
        if present:
            dst.add_(src)
        else:
            dst.copy_(src)

    def _take_staging(self) -> Tensor:
        """A free staging buffer: the largest block's bytes in fp32 (a block's gradients may mix dtypes)."""
        if self._staging:
            return self._staging.pop()
        nbytes = max(b.numel for b in self.store.blocks) * 4
        staging = host_empty(nbytes, torch.uint8, self.store.pin_memory)
        self.staging_bytes += staging.untyped_storage().nbytes()
        return staging
