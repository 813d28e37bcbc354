"""The least disk traffic a step's schedule needs through the disk tier's host cache (what an optimal cache
achieves), the floor the store's measured traffic is held to (``tests/test_disk_traffic.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DiskTraffic:
    """Bytes a step moves between the disk tier's files and its cache, by what they hold."""

    weights_read: float
    state_read: float
    grads_read: float
    weights_written: float
    state_written: float
    grads_written: float

    @property
    def reads(self) -> float:
        return self.weights_read + self.state_read + self.grads_read

    @property
    def writes(self) -> float:
        return self.weights_written + self.state_written + self.grads_written


def least_disk_traffic(
    weights: float, state: float, cache: float, micro_batches: int = 1, in_use: float = 0.0
) -> DiskTraffic:
    """The least a step's schedule moves through a host cache of ``cache`` bytes, whatever its policy
    (what Belady's optimal cache achieves on it): ``weights`` (fp32, also the size of the gradient sums)
    and ``state`` (Adam m and v) bytes on disk, ``micro_batches`` passes per step, ``in_use`` bytes the
    cache must hold besides (the gradients of the block in backward until its update).

    Each pass is a zigzag: forward over blocks 0..n-1, backward n-1..0; the last pass updates each block
    at its backward (reading m and v, writing weights, m and v once). A block's weights are reused from
    its forward to its backward (across the turn of the pass, an interval that holds every later block's
    use) and from its backward to the next pass's forward (across the pass boundary). Every reuse interval
    spans a turn or a boundary, so what a cache keeps is bounded at those 2 x ``micro_batches`` points
    only: it keeps at each one up to ``cache`` of weights (the blocks nearest the turn, the blocks nearest
    the boundary: the two sets do not overlap in time), which saves one weight read per byte, and, with
    room to spare, the gradient sums between passes (each byte kept over a boundary and the next turn saves
    a write and a read) and then the optimizer state (kept through all of them, one read saved). Writes:
    weights, m and v once; gradient sums whenever the cache cannot hold them between passes.
    """
    room = max(cache - in_use, 0.0)
    k = micro_batches
    kept_weights = min(weights, room)
    spare = room - kept_weights
    kept_grads = min(weights, spare) if k > 1 else 0.0
    kept_state = min(state, spare - kept_grads)
    spilled = (k - 1) * (weights - kept_grads)
    return DiskTraffic(
        weights_read=2 * k * (weights - kept_weights),
        state_read=state - kept_state,
        grads_read=spilled,
        weights_written=weights,
        state_written=state,
        grads_written=spilled,
    )
