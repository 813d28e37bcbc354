"""Waiting for work done in another thread without keeping the waiter's frames alive."""

from __future__ import annotations

import copy
from concurrent.futures import Future
from typing import Any


def result_of(future: Future) -> Any:
    """``future.result()``, but a failure is raised as a copy of the stored exception.

    Raising the stored exception itself would extend its traceback with the waiting thread's frames
    (a backward pass's, holding autograd graphs) while the future, kept by the engine, still holds
    it: a cycle through autograd's C++ nodes that the garbage collector cannot break, so a failed
    run would keep its engine, store and cache alive.
    """
    failure = future.exception()  # waits; unlike result(), does not raise the stored exception
    if failure is None:
        return future.result()
    raise fresh_copy(failure) from failure


def fresh_copy(failure: BaseException) -> BaseException:
    """A new exception with ``failure``'s type and message, to raise where ``failure`` itself is kept
    by a long-lived object (see :func:`result_of`)."""
    try:
        return copy.copy(failure)
    except Exception:  # an exception type that cannot be rebuilt from its args
        return RuntimeError(f"{type(failure).__name__}: {failure}")
