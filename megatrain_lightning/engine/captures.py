"""Outputs that Hugging Face collects from inside a block, routed out through the block's call.

A model asked for ``output_router_logits`` (a mixture of experts' load-balancing loss),
``output_attentions`` or hidden states of sub-layers records them with forward hooks on modules
inside its decoder layers (``transformers.utils.output_capturing``). Under megatrain such a tensor
would leave the block outside the block's outputs, and its gradient could not reach the block's
weights, which are paged out by then. So a paged call runs its block with the collector watched:
what the block appended becomes extra outputs of the call, and the collector holds the call's outputs
in their place. The recompute in backward runs under a stand-in collector of the same shape, so the
hooks append the same tensors again and their gradients flow through the block like any output's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

CAPTURING_MODULE = "transformers.utils.output_capturing"


def routes_captures() -> bool:
    """Whether the installed transformers collects outputs through the collector watched here (5 and
    later; earlier versions collect them otherwise, out of this module's reach). The collector is
    transformers' private ``_active_collector``: tests/test_zoo.py trains every mixture of experts
    through it."""
    return importlib.util.find_spec(CAPTURING_MODULE) is not None


def _collector_variable() -> Any:
    """The context variable holding the collector of the model call under way, or ``None`` when no model
    that collects outputs has been imported."""
    capturing = sys.modules.get(CAPTURING_MODULE)
    return None if capturing is None else capturing._active_collector


@dataclass
class Captures:
    """What one call's block appended to the collector: the entries (key, index); the lengths of the
    collector's lists before the call and its entries that are not lists (``settings``: which hidden states
    to keep), which the recompute's stand-in repeats (a hook may read them)."""

    lengths: dict[str, int] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    entries: list[tuple[str, int]] = field(default_factory=list)

    @contextlib.contextmanager
    def watching(self, recompute: bool) -> Iterator[list[Tensor]]:
        """Run a block with the collector watched; the list yielded receives the tensors it appended.

        In the first run the model's own collector is watched; in a recompute (no collector is active
        then) a stand-in of the same shape, whose appends must be the first run's again.
        """
        appended: list[Tensor] = []
        variable = _collector_variable()
        if variable is None or (recompute and not self.lengths):
            yield appended  # nothing collects, or the first run collected nothing
            return
        if recompute:
            collector = {key: [None] * length for key, length in self.lengths.items()} | self.settings
            token = variable.set(collector)
        else:
            collector, token = variable.get(), None
            if not collector:
                yield appended
                return
            self.lengths = {k: len(v) for k, v in collector.items() if isinstance(v, list)}
            self.settings = {k: v for k, v in collector.items() if not isinstance(v, list)}
        try:
            yield appended
        finally:
            if token is not None:
                variable.reset(token)
        self._record(collector, recompute)
        appended.extend(collector[key][index] for key, index in self.entries)

    def _record(self, collector: dict[str, Any], recompute: bool) -> None:
        """The entries the block appended; a recompute must append the first run's."""
        entries = [
            (key, index)
            for key, length in self.lengths.items()
            for index in range(length, len(collector[key]))
            if isinstance(collector[key][index], Tensor)
        ]
        if recompute and entries != self.entries:
            raise RuntimeError(
                "megatrain: a block's recompute recorded other outputs than its first run "
                f"({entries} after {self.entries}); its forward must record the same outputs each run."
            )
        self.entries = entries

    def hand_over(self, tensors: tuple[Tensor, ...]) -> None:
        """Put the call's outputs in the model's collector where the block's own tensors were."""
        if not self.entries:
            return
        collector = _collector_variable().get()
        for (key, index), tensor in zip(self.entries, tensors, strict=True):
            collector[key][index] = tensor
