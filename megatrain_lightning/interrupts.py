"""Ctrl-C during a step. megatrain updates each block as soon as its gradient is final, while the backward
still runs, so a step cut short leaves the weights between two steps: no checkpoint can hold them
(``serialization/checkpoint.py`` writes none) and the work since the last one is lost. The first Ctrl-C
inside an optimizer step therefore lets the step finish and stops right after it, at the next step, eval
loop or the end of training, where Lightning's own handling (``OnExceptionCheckpoint``, the loggers) sees
whole steps; a second Ctrl-C stops at once. With several ranks, all stop there when any one was
interrupted: one stopping alone would leave the others waiting in the next step's collectives, and a
checkpoint needs them all."""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_prefixed_message
from lightning.pytorch.strategies import ParallelStrategy
from torch.optim import Optimizer
from typing_extensions import override

FINISHING = (
    "megatrain: Ctrl-C: finishing this step first, then stopping (its blocks update during the backward, "
    "and a step cut short leaves the weights between two steps, which no checkpoint can hold). "
    "Press Ctrl-C again to stop at once: the step is then lost, and once its updates began no checkpoint "
    "can hold the weights."
)


class DeferredInterrupt:
    """Holds a Ctrl-C that arrived inside a step until the step is whole."""

    def __init__(self) -> None:
        self.pending = False

    @contextlib.contextmanager
    def finishing_the_step(self, rank: int = 0) -> Iterator[None]:
        """While the step runs, the first Ctrl-C is noted (and said, by the rank that got it) instead of
        raised. Only where Python's own handler is installed (and so only in the main thread): a handler of
        the user's or of the host is kept."""
        if (
            threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        ):
            yield
            return
        signal.signal(signal.SIGINT, functools.partial(self._note, rank))
        try:
            yield
        except BaseException:
            self.pending = False  # the run ends with this error (or with the second Ctrl-C)
            raise
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def _note(self, rank: int, signum: int, frame: FrameType | None) -> None:
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True
        logging.getLogger("lightning.pytorch").info(
            rank_prefixed_message(FINISHING, rank) if rank else FINISHING
        )


class FinishesStepsOnCtrlC(ParallelStrategy):
    """The strategy's side of :class:`DeferredInterrupt`: steps run under it, and a Ctrl-C noted on any rank
    is raised on every rank at the first hook after the step's bookkeeping (the next batch, an eval loop,
    the end of training)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.interrupt = DeferredInterrupt()

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        with self.interrupt.finishing_the_step(self.global_rank):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._raise_pending()
        super().on_train_batch_start(batch, batch_idx)

    @override
    def on_validation_start(self) -> None:
        self._raise_pending()
        super().on_validation_start()

    @override
    def on_train_end(self) -> None:
        self._raise_pending()
        super().on_train_end()

    def _raise_pending(self) -> None:
        """Stop now if a Ctrl-C waited for the step to end, on this rank or another (data parallel: a
        collective at each batch, as Lightning's for SIGTERM)."""
        pending = self.interrupt.pending
        if self.world_size > 1:
            pending = self.reduce_boolean_decision(pending, all=False)
        if pending:
            self.interrupt.pending = False
            raise KeyboardInterrupt
