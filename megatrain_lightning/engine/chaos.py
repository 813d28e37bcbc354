"""Test-only fault and delay injection at the engine's hand-offs (the chaos tests, issue 17).

The engine, the store and the checkpoint code call :func:`point` wherever one thread hands a block to
another (a block copy, a gradient add, an update, a disk read or write, a checkpoint file). Off (the
default) that is one global lookup. On, each hit may sleep a seeded random time, raise an injected
``OSError`` or SIGKILL the process, so the tests can show that the ordering rules hold under any timing
and that no fault loses work. Turn it on with the environment variable (read at import, so it reaches
subprocesses)::

    MEGATRAIN_CHAOS="seed=3,delay_ms=20,p=0.5,fail=disk.write:5:ENOSPC,kill=update.after:7"

(``delay_ms``: the longest delay; ``p``: the chance that a hit sleeps; ``fail=NAME:K:ERRNO``: the ``K``-th
hit of a point whose name starts with ``NAME`` raises ``OSError(ERRNO)`` for the file it names;
``kill=NAME:K``: that hit SIGKILLs the process), or in-process with :func:`enabled`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

ENV = "MEGATRAIN_CHAOS"


@dataclass
class Chaos:
    """What to inject. Delays are a function of (seed, point, hit number), not of thread order."""

    seed: int = 0
    delay_ms: float = 0.0
    p: float = 1.0
    fail: tuple[str, int, int] | None = None  # (point prefix, k-th matching hit, errno)
    kill: tuple[str, int] | None = None  # (point prefix, k-th matching hit)
    hits: dict[str, int] = field(default_factory=dict)  # point name -> hits so far
    matched: dict[str, int] = field(default_factory=dict)  # "fail"/"kill" -> matching hits so far
    injected: list[str] = field(default_factory=list)  # what was raised, for the tests
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def parse(cls, spec: str) -> Chaos:
        chaos = cls()
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, _, value = item.partition("=")
            if key == "seed":
                chaos.seed = int(value)
            elif key == "delay_ms":
                chaos.delay_ms = float(value)
            elif key == "p":
                chaos.p = float(value)
            elif key == "fail":
                name, k, code = value.split(":")
                chaos.fail = (name, int(k), getattr(errno, code))
            elif key == "kill":
                name, k = value.split(":")
                chaos.kill = (name, int(k))
            else:
                raise ValueError(f"{ENV}: unknown setting {key!r} in {spec!r}")
        return chaos

    def hit(self, name: str, path: str | None) -> None:
        with self._lock:
            k = self.hits[name] = self.hits.get(name, 0) + 1
            fail = self._matches("fail", self.fail, name)
            kill = self._matches("kill", self.kill, name)
        if kill:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.delay_ms:
            draw = random.Random(f"{self.seed}/{name}/{k}")
            if draw.random() < self.p:
                time.sleep(draw.uniform(0.0, self.delay_ms) / 1e3)
        if fail:
            code = self.fail[2]
            self.injected.append(f"{name}:{path}")
            raise OSError(code, f"{os.strerror(code)} (injected by {ENV} at {name})", path)

    def _matches(self, what: str, rule: tuple | None, name: str) -> bool:
        if rule is None or not name.startswith(rule[0]):
            return False
        n = self.matched[what] = self.matched.get(what, 0) + 1
        return n == rule[1]


_active: Chaos | None = Chaos.parse(os.environ[ENV]) if os.environ.get(ENV) else None


def point(name: str, path: str | None = None) -> None:
    """A hand-off named ``name`` (about ``path``, for file I/O); nothing unless chaos is on."""
    if _active is not None:
        _active.hit(name, path)


@contextlib.contextmanager
def enabled(spec: str | Chaos) -> Iterator[Chaos]:
    """Chaos on for the block (e.g. ``enabled("seed=3,delay_ms=20")``), then off again."""
    global _active
    chaos = Chaos.parse(spec) if isinstance(spec, str) else spec
    previous, _active = _active, chaos
    try:
        yield chaos
    finally:
        _active = previous
