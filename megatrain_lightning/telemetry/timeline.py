"""A recorder of when the engine fetched, computed, offloaded, updated and did disk I/O, and its plot.

The engine's threads report spans with ``TIMELINE.record(lane, start, end)`` (``time.perf_counter()``
seconds) or ``with TIMELINE.span(lane):``. Recording is off unless a consumer (e.g.
``MegaTrainMonitor(timeline_step=...)``) turns it on for one step, so when off a call costs one
attribute read. :func:`render` draws the spans as one row per lane, which shows how well the
transfers overlap the compute.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

LANES = ("fetch", "compute", "offload", "optimizer", "disk")
_COLORS = {
    "fetch": "tab:blue",
    "compute": "tab:green",
    "offload": "tab:orange",
    "optimizer": "tab:red",
    "disk": "tab:purple",
}


@dataclass(frozen=True)
class Event:
    lane: str
    start: float
    end: float


class Timeline:
    """Thread-safe list of spans, kept only while ``enabled``."""

    def __init__(self) -> None:
        self.enabled = False
        self._events: list[Event] = []
        self._lock = threading.Lock()

    def record(self, lane: str, start: float, end: float) -> None:
        """Note that ``lane`` was busy from ``start`` to ``end`` (``time.perf_counter()`` seconds)."""
        if not self.enabled:
            return
        with self._lock:
            self._events.append(Event(lane, start, end))

    @contextmanager
    def span(self, lane: str) -> Iterator[None]:
        """Record the duration of the ``with`` body in ``lane``."""
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(lane, start, time.perf_counter())

    def start(self) -> None:
        """Forget earlier spans and begin recording."""
        with self._lock:
            self._events = []
        self.enabled = True

    def stop(self) -> list[Event]:
        """Stop recording and return the spans recorded since :meth:`start`."""
        self.enabled = False
        with self._lock:
            events, self._events = self._events, []
        return events


TIMELINE = Timeline()
"""The recorder the engine reports to."""


def render(events: Iterable[Event], path: str | Path, origin: float | None = None, title: str = "") -> Path:
    """Draw ``events`` as a PNG at ``path``: one row per lane, time in ms after ``origin``.

    ``origin`` defaults to the earliest start. Lanes other than :data:`LANES` get rows below them.
    Uses matplotlib's Agg canvas directly, so no GUI backend and no pyplot state are involved.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            'Drawing a timeline needs matplotlib: pip install "megatrain-lightning[plot]"'
        ) from err

    events = list(events)
    lanes = list(LANES) + sorted({e.lane for e in events} - set(LANES))
    if origin is None:
        origin = min((e.start for e in events), default=0.0)
    fig = Figure(figsize=(10, 1.2 + 0.45 * len(lanes)), dpi=100)
    ax = fig.add_subplot()
    for row, lane in enumerate(lanes):
        spans = [((e.start - origin) * 1e3, (e.end - e.start) * 1e3) for e in events if e.lane == lane]
        if spans:
            ax.broken_barh(
                spans,
                (row - 0.4, 0.8),
                facecolors=_COLORS.get(lane, "tab:gray"),
                edgecolor="white",
                linewidth=0.5,
            )
    if not events:
        ax.text(0.5, 0.5, "no events recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlabel("ms since step start")
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
