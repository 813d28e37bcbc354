"""A tensor several blocks' calls take (an encoder's output, which every decoder layer's cross-attention
reads): its gradient summed use by use, in the order plain autograd sums it.

Autograd adds the gradients a tensor receives one use at a time, in the order it runs the uses: with two
decoder layers reading the encoder's output through their key and value projections, ((v1 + k1) + v0) + k0.
A paged call's backward sums its own block's uses (its inner autograd) and hands the outer autograd that
sum, which would give (v1 + k1) + (v0 + k0), a rounding apart. So while an earlier call that uses the
tensor more than once is still to run, a call carries its sum on to the next call to run instead of
handing it out, and that call's inner autograd starts from it: an extra root, a view of the input made
after the block's graph, which autograd therefore runs before the block's own uses. Where no call still to
run uses it more than once, the sum is handed out as before (each further use is added alone either way),
so uses outside the blocks' calls in between (a concatenation of layer outputs) still fall in their place.
Where both meet, a call using the tensor several times and a use outside the calls while a sum is
carried, the sums stay a rounding apart. Under autocast a call reads a leaf input through a view
(``paged_call._as_non_leaf``): its uses are the view's, and a carried sum starts there.
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor


class Takers:
    """The paged calls (their autograd nodes) that took one tensor, in forward order, with whether each
    uses it more than once; the sum a backward carries from one to the next, and the calls it ran, with the
    backward they belong to (one that failed leaves them)."""

    __slots__ = ("tensor", "calls", "carried", "ran", "task")

    def __init__(self, tensor: weakref.ref) -> None:
        self.tensor = tensor
        self.calls: list[tuple[weakref.ref, bool]] = []
        self.carried: Tensor | None = None
        self.ran: set[int] = set()
        self.task = -1

    def this_backward(self) -> Takers:
        """Itself, what a failed or earlier backward left forgotten."""
        task = torch._C._current_graph_task_id()
        if task != self.task:
            self.task, self.carried, self.ran = task, None, set()
        return self


class SharedInputs:
    """The takers of each tensor given to a paged call, while the tensor lives."""

    def __init__(self) -> None:
        self._takers: dict[int, Takers] = {}

    def note(self, ctx: Any, tensors: Sequence[Tensor], uses: Counter[int]) -> dict[int, Takers]:
        """At a call's forward: the call joins the takers of each input that takes a gradient (an input given
        twice to one call is left to autograd); ``uses``: how many ops of the block's graph take each
        (:func:`uses_in`). Returns the takers by input position."""
        counts = Counter(id(t) for t in tensors)
        noted = {}
        for position, tensor in enumerate(tensors):
            if not tensor.requires_grad or counts[id(tensor)] > 1:
                continue
            takers = self._takers.get(id(tensor))
            if takers is None or takers.tensor() is not tensor:
                forget = functools.partial(_forget, self._takers, id(tensor))
                takers = self._takers[id(tensor)] = Takers(weakref.ref(tensor, forget))
            takers.calls = [c for c in takers.calls if c[0]() is not None]  # earlier graphs' are freed
            takers.calls.append((weakref.ref(ctx), uses[position] > 1))
            noted[position] = takers
        return noted


def uses_in(outputs: Sequence[Tensor], inputs: Sequence[Tensor], views: Mapping[int, Tensor]) -> Counter[int]:
    """By position, how many ops of the graph of ``outputs`` take each of ``inputs`` (the call's detached
    inputs, leaves of its graph), or of the view the call read it through (``views``, by position: under
    autocast, ``paged_call._as_non_leaf``), where its gradients gather."""
    positions = {id(t): i for i, t in enumerate(inputs) if t.requires_grad}
    through = {view.grad_fn: i for i, view in views.items()}
    uses: Counter[int] = Counter()
    stack, seen = [o.grad_fn for o in outputs if o.grad_fn is not None], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for next_node, _ in node.next_functions:
            if next_node is None:
                continue
            if next_node in through:
                uses[through[next_node]] += 1
                continue
            leaf = getattr(next_node, "variable", None)  # AccumulateGrad: a leaf
            if leaf is None:
                stack.append(next_node)
            elif id(leaf) in positions:
                uses[positions[id(leaf)]] += 1
    return uses


def _forget(takers: dict[int, Takers], key: int, tensor: weakref.ref) -> None:
    if (entry := takers.get(key)) is not None and entry.tensor is tensor:
        del takers[key]


def carried_sums(
    ctx: Any, noted: dict[int, Takers], inputs: Sequence[Tensor], views: Mapping[int, Tensor]
) -> list[tuple[Tensor, Tensor]]:
    """At a call's backward: for each input a later call carried a sum to, a root of the block's inner
    autograd (a view of the input, or of the view the call read it through, made now so autograd runs it
    first) and that sum as its gradient."""
    seeds = []
    for position, takers in noted.items():
        takers = takers.this_backward()
        takers.ran.add(id(ctx))
        carried, takers.carried = takers.carried, None
        if carried is not None and inputs[position].requires_grad:
            with torch.enable_grad():
                read = views.get(position, inputs[position])
                seeds.append((read.view_as(read), carried))
    return seeds


def hand_on(ctx: Any, noted: dict[int, Takers], input_grads: list[Tensor | None]) -> None:
    """At the end of a call's backward: while an earlier taker this backward has still to run uses the
    input more than once, carry its sum on (to the next taker to run, whatever its uses: it passes the sum
    through), handing the outer autograd nothing for it (``None`` in ``input_grads``)."""
    for position, takers in noted.items():
        if input_grads[position] is not None and _an_earlier_taker_uses_it_again(takers.this_backward(), ctx):
            takers.carried, input_grads[position] = input_grads[position], None


def _an_earlier_taker_uses_it_again(takers: Takers, ctx: Any) -> bool:
    """Whether a call before ``ctx`` that this backward has still to run uses the tensor more than once."""
    for call, several in takers.calls:
        node = call()
        if node is ctx:
            return False
        if (
            several
            and node is not None
            and id(node) not in takers.ran
            and torch._C._will_engine_execute_node(node)
        ):
            return True
    return False
