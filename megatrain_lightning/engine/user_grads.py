"""``p.grad`` as user code sees it under megatrain: a copy of the store's gradient sum whose changes count.

Under plain PyTorch ``p.grad`` is one tensor that user code may change before the optimizer step
(``torch.nn.utils.clip_grad_norm_``, ``p.grad.mul_``, ``p.grad.data.clamp_``, ``zero_grad(set_to_none=
False)``) or replace (``p.grad = ...``). Under megatrain the sums live in the store and ``p.grad`` hands out
a copy on the device. :class:`HandedGrads` keeps track of those copies so that what user code does to
them reaches the sums (:class:`~.grads.HostGrads` writes them back before the sums are next used): a copy
is the same tensor at every read while user code holds it, held only weakly (reading every gradient, to
log norms, must not gather them all on the device), and one that was changed and let go is kept until it
is written back.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

Key = tuple[int, int]  # (block, parameter index)


class GradCopy(Tensor):
    """A handed-out ``p.grad``. Its ``.data`` is itself: a plain tensor's ``.data`` has a version counter
    of its own and outlives the tensor in ``p.grad.data.clamp_(...)``, so that change would go unseen (a
    gradient has no history for ``.data`` to detach from); setting it sets its values. Otherwise a plain
    tensor (no torch-function dispatch, results are plain tensors)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def data(self) -> Tensor:  # type: ignore[override]
        return self

    @data.setter
    def data(self, value: Tensor) -> None:
        """``p.grad.data = v`` (``Module._apply`` sets it in a cast or move of the module that leaves it
        paged: ``.float()``, ``.cpu()``): ``v``'s values become this gradient's, written back as a change."""
        if value is not self:
            self.copy_(value)


@dataclass(eq=False)
class _Handed:
    tensor: Callable[[], Tensor | None]  # the tensor while user code holds it (an assigned one: always)
    version: int | None  # its version when handed out; None: assigned, so written back as it is


class HandedGrads:
    """The ``p.grad`` tensors handed to (or assigned by) user code since the sums were last used."""

    def __init__(self) -> None:
        self._handed: dict[Key, _Handed] = {}
        # Copies user code dropped: an alias of each (sharing its version counter) and its version when
        # handed out. Whether it changed is asked when it is needed: a view of it may still be changed.
        self._let_go: list[tuple[Key, Tensor, int | None]] = []

    def __bool__(self) -> bool:
        """Whether anything was handed out or let go since the last :meth:`take_all` (the offload's check)."""
        return bool(self._handed or self._let_go)

    def held(self, key: Key) -> Tensor | None:
        handed = self._handed.get(key)
        return None if handed is None else handed.tensor()

    def hand_out(self, key: Key, copy: Tensor) -> Tensor:
        copy = copy.as_subclass(GradCopy)
        handed = _Handed(weakref.ref(copy), copy._version)
        self._handed[key] = handed
        weakref.finalize(copy, self._dropped, key, handed, copy.detach())
        return copy

    def assign(self, key: Key, value: Tensor | None) -> None:
        """``p.grad = value``: from now on ``value`` is the gradient (``None``: forget the key)."""
        if value is None:
            self._handed.pop(key, None)
        else:
            self._handed[key] = _Handed(lambda: value, None)

    def take_let_go(self) -> list[tuple[Key, Tensor]]:
        """The changed copies user code has dropped (to write back before a new copy is made)."""
        let_go, self._let_go = self._let_go, []
        return [(key, alias) for key, alias, version in let_go if alias._version != version]

    def take_all(self) -> list[tuple[Key, Tensor]]:
        """Every change to write back, and forget everything handed out: the sums are about to be used."""
        handed, self._handed = self._handed, {}
        changed = []
        for key, entry in handed.items():
            tensor = entry.tensor()
            if tensor is not None and (entry.version is None or tensor._version != entry.version):
                changed.append((key, tensor))
        return self.take_let_go() + changed

    def clear(self) -> None:
        self._handed.clear()
        self._let_go.clear()

    def _dropped(self, key: Key, handed: _Handed, alias: Tensor) -> None:
        if self._handed.get(key) is handed:  # not written back or cleared since it was handed out
            del self._handed[key]
            self._let_go.append((key, alias, handed.version))
