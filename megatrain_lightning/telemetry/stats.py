"""Counters the engine keeps while it runs (``trainer.strategy.stats``)."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

_ADDING = threading.Lock()


@dataclass
class EngineStats:
    peak_slot_bytes: int = 0  # most parameter bytes ever resident in device slots at once
    fetch_wait_s: float = 0.0  # compute-thread time spent waiting for a block to become resident
    host_bytes: int = 0  # host RAM the store (weights, gradients, optimizer state) and gradient staging hold
    h2d_bytes: int = 0  # bytes read from host memory into device slots (bf16 runs from the shadow: 2 each)
    h2d_s: float = 0.0  # time spent in those copies (worker and compute threads)
    d2h_bytes: int = 0  # gradient bytes copied device -> host
    optimizer_s: float = 0.0  # time spent in block updates (worker threads)
    optimizer_wait_s: float = 0.0  # compute-thread time spent waiting for block updates
    offload_wait_s: float = 0.0  # compute-thread time spent waiting for a gradient offload to finish
    trace_deviations: int = 0  # passes that left the recorded block order
    disk_read_bytes: int = 0  # disk tier: bytes read from offload_dir
    disk_write_bytes: int = 0
    disk_read_s: float = 0.0  # time in reads (I/O threads, summed)
    disk_write_s: float = 0.0
    peak_host_cache_bytes: int = 0  # disk tier: most bytes the host cache ever held
    optimizer_state_bytes: int = 0  # bytes the store holds for Adam m, v and their scales
    gathered_bytes: int = 0  # data parallel: bytes of other ranks' shards received by all-gathers
    reduce_scattered_bytes: int = 0  # data parallel: bytes of other ranks' shares sent by reduce-scatters
    gathers_ahead: int = 0  # data parallel: gathers started before their block was needed (the trace's)

    def add(self, **amounts: float) -> None:
        """Add to counters; any thread may (two bare ``+=`` at once can lose one of them)."""
        with _ADDING:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)
