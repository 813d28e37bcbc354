"""The trace: the order in which blocks were needed in one pass, recorded and replayed.

A pass is one micro-batch's forward and backward (or one evaluation step's forward). The last
complete pass of each kind predicts the next one; while the accesses match it, the pager can
fetch ahead. A deviation stops prediction for the rest of the pass, and the new order is what
the next pass will follow.
"""

from __future__ import annotations

import collections

Access = tuple[int, bool]  # (block index, is backward)


class Trace:
    def __init__(self) -> None:
        self._recorded: dict[str, list[Access]] = {}
        self._current: dict[str, list[Access]] = {}
        self._kind = ""
        self._replay: list[Access] = []
        self._last_use: dict[int, int] = {}
        self._pos = -1
        self.following = False
        self.deviations = 0

    def begin_pass(self, kind: str) -> None:
        """Start a pass; the previous complete pass of ``kind`` becomes the prediction."""
        if self._current.get(kind):
            self._recorded[kind] = self._current[kind]
        self._current[kind] = []
        self._kind = kind
        self._replay = self._recorded.get(kind, [])
        self._last_use = {block: i for i, (block, _) in enumerate(self._replay)}
        self._pos = -1
        self.following = bool(self._replay)

    def state_dict(self) -> dict[str, list[list[int]]]:
        """The prediction for the next pass of each kind (the last complete one), as plain lists."""
        passes = self._recorded | {kind: accesses for kind, accesses in self._current.items() if accesses}
        return {kind: [[block, int(back)] for block, back in accesses] for kind, accesses in passes.items()}

    def load_state_dict(self, state: dict[str, list[list[int]]]) -> None:
        """Predict the next passes from a saved trace (a resumed run), as if they had just run."""
        self._recorded = {k: [(block, bool(back)) for block, back in passes] for k, passes in state.items()}
        self._current = {}

    def access(self, access: Access) -> None:
        self._current.setdefault(self._kind, []).append(access)
        if not self.following:
            return
        nxt = self._pos + 1
        if nxt < len(self._replay) and self._replay[nxt] == access:
            self._pos = nxt
        else:
            self.following = False
            self.deviations += 1

    def upcoming(self, limit: int | None = None) -> list[Access]:
        """Predicted accesses after the current one, the next ``limit`` of them if given (empty when not
        following)."""
        if not self.following:
            return []
        start = self._pos + 1
        return self._replay[start : None if limit is None else start + limit]

    def future(self) -> tuple[list[Access], list[Access]]:
        """The rest of this pass from the current access on, and the whole next pass, as predicted
        (only the current access when not following)."""
        if self.following:
            return self._replay[max(self._pos, 0) :], self._replay
        return self._current.get(self._kind, [])[-1:], []

    def is_last_use(self, block: int) -> bool:
        """True when the current access is, by the prediction, this pass's last use of ``block``."""
        return self.following and self._last_use.get(block) == self._pos


class UpdateCadence:
    """Predicts whether the next training pass ends in an optimizer update (gradient accumulation
    updates every k-th pass) from the spacing of the last two updates."""

    def __init__(self) -> None:
        self._since_update = 0  # passes since the last update pass, counting the current one
        self._every = 1

    def record(self, updates: bool) -> None:
        """A training pass begins; ``updates``: it ends in an optimizer update."""
        if updates:
            self._every, self._since_update = self._since_update + 1, 0
        else:
            self._since_update += 1

    def next_updates(self) -> bool:
        return self._since_update + 1 >= self._every

    def state_dict(self) -> dict[str, int]:
        return {"every": self._every, "since_update": self._since_update}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._every, self._since_update = state["every"], state["since_update"]


class PendingBackwards:
    """Per block, the training calls of this pass whose backward has not run. The backward that brings a
    block's count to zero is its last in the pass: exact, since a pass runs all its forwards before its
    backward and automatic optimization one backward per pass. The trace only predicts last uses from the
    pass before, and a first pass has none: its updates would all wait for the step's end, every block's
    gradients held meanwhile."""

    def __init__(self) -> None:
        self._due: collections.Counter[int] = collections.Counter()

    def clear(self) -> None:
        self._due.clear()

    def forward(self, block: int) -> None:
        self._due[block] += 1

    def backward(self, block: int) -> bool:
        """One backward of ``block`` ran; whether none is due any more."""
        self._due[block] -= 1
        return self._due[block] == 0
