"""Block updates in worker threads: which are pending, which failed, and who waits for them.

Thread contract: the compute thread submits updates (``submit``, from ``CPUAdamW.block_ready`` and
``step``) and waits (``wait_for_room`` in backward, ``wait_all`` at the step's end); on CUDA the
gradient-offload worker submits too; the pool's workers run the updates (without workers, the submitting
thread runs each at once: the CPU over a store in RAM, see :mod:`..engine.threads`). Readers of a
block (the pager's loads) do not come here: the store makes them wait for the change ``prepare``
announced. ``_pending`` and ``_submitted`` are shared between those threads under ``_lock``; a block's
buffers and step counters are touched only by its update, or by a thread that waited for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_for_any

import torch

from megatrain_lightning.engine.chaos import point
from megatrain_lightning.engine.futures import fresh_copy
from megatrain_lightning.engine.threads import bulk_threads, worker_pool
from megatrain_lightning.telemetry.stats import EngineStats

log = logging.getLogger(__name__)


class FirstFailure:
    """The first failed update. The weights are then no longer one step's, so every later wait raises it,
    in whichever thread, until the updates are closed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._reported = False

    def record(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error

    def raise_if_any(self) -> None:
        with self._lock:
            error = self._error
            self._reported = self._reported or error is not None
        if error is not None:
            raise fresh_copy(error) from error

    def log_unreported(self) -> None:
        if self._error is not None and not self._reported:
            log.error(f"megatrain: a block update failed and no one waited for it: {self._error!r}")


class UpdateQueue:
    """At most one pending update per block, run by ``threads`` workers (``0``: each in the thread that
    submits it); back-pressure at ``2 * threads``. The workers' parallel ops use the cores that compute on
    ``device`` leaves (:mod:`..engine.threads`)."""

    def __init__(self, threads: int, stats: EngineStats, device: torch.device | None = None) -> None:
        self.stats = stats
        self.max_queued = 2 * threads
        intra_op = bulk_threads(device or torch.device("cpu"), max(threads, 1))
        self._pool = worker_pool(threads, "megatrain-adamw", intra_op) if threads else None
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}  # block -> its latest update (kept once done)
        self._submitted: set[int] = set()  # blocks submitted since ``new_step``
        self.failure = FirstFailure()

    def submitted(self, block: int) -> bool:
        with self._lock:
            return block in self._submitted

    def any_submitted(self) -> bool:
        return self.submitted_count() > 0

    def submitted_count(self) -> int:
        """Blocks whose update this step submitted."""
        with self._lock:
            return len(self._submitted)

    def new_step(self) -> None:
        with self._lock:
            self._submitted.clear()

    def submit(self, block: int, prepare: Callable[[Future], None], run: Callable[[], None]) -> None:
        """Queue ``run`` as ``block``'s update after ``prepare(future)`` (in this thread), which announces
        the change and its future to the store. The future resolves on every path."""
        self.failure.raise_if_any()  # after a failed update nothing more changes
        future: Future = Future()
        point("update.submit")
        with self._lock:
            self._submitted.add(block)
            self._pending[block] = future
        try:
            prepare(future)
            if self._pool is None:
                self._run(run, future)
            else:
                self._pool.submit(self._run, run, future)
        except BaseException as err:
            # Kept as a copy: err's traceback holds this thread's frames (see ``result_of``).
            self.failure.record(fresh_copy(err))
            future.set_exception(fresh_copy(err))
            raise

    def _run(self, run: Callable[[], None], future: Future) -> None:
        try:
            point("update.before")
            run()
            point("update.after")
            future.set_result(None)
        except BaseException as err:  # re-raised in whoever waits next
            self.failure.record(err)
            future.set_exception(err)

    def wait(self, block: int) -> None:
        """Block until ``block``'s pending update (if any) has been applied; raise if any update failed."""
        with self._lock:
            future = self._pending.get(block)
        if future is not None and not future.done():
            start = time.perf_counter()
            future.exception()  # waits without raising
            self.stats.add(optimizer_wait_s=time.perf_counter() - start)
        self.failure.raise_if_any()

    def wait_all(self) -> None:
        for future in self._all():
            future.exception()
        self.failure.raise_if_any()

    def wait_for_room(self) -> None:
        """Back-pressure for the backward pass: with more than ``max_queued`` updates queued or running,
        wait until one of them is done. A backward that runs far ahead of the updates only piles up
        gradients (which the disk tier must then spill); the updates decide when the next forward starts."""
        with self._lock:
            queued = [f for f in self._pending.values() if not f.done()]
        if len(queued) > self.max_queued:
            start = time.perf_counter()
            wait_for_any(queued, return_when=FIRST_COMPLETED)
            self.stats.add(optimizer_wait_s=time.perf_counter() - start)
        self.failure.raise_if_any()

    def close(self) -> None:
        """Wait for the updates still running and stop the workers. A failure already raised is not raised
        again (a later ``fit`` starts clean with new updates); one never raised is logged."""
        for future in self._all():
            future.exception()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.failure.log_unreported()

    def futures(self) -> list[Future]:
        """Every block's latest update (for tests and diagnostics)."""
        return self._all()

    def _all(self) -> list[Future]:
        with self._lock:
            return list(self._pending.values())
