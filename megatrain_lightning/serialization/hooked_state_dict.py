"""The ``checkpoint["state_dict"]`` Lightning's checkpoint hooks see under megatrain, and their changes.

megatrain writes every weight from its store into the checkpoint folder, and loads them from there into the
store, block by block: neither goes through the dict the hooks (``on_save_checkpoint``,
``on_load_checkpoint``, of the module and the callbacks) see. Under the default strategy a hook that removes,
adds, renames or replaces an entry changes what is saved or loaded; here the change would be lost
silently, so it is refused, before anything is written or loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import Tensor

from megatrain_lightning.serialization.checkpoint_dir import CheckpointDir

_SAVED = (
    "megatrain: a checkpoint hook (`on_save_checkpoint`) changed `checkpoint['state_dict']` ({change}); "
    "megatrain writes every weight from its store, block by block, so the checkpoint would not hold the "
    "change, and nothing was written. Leave `checkpoint['state_dict']` as it is (tensors of your own can "
    "go under a key of your own in `checkpoint`), or train with the default strategy."
)
_LOADED = (
    "megatrain: a checkpoint hook (`on_load_checkpoint`) changed `checkpoint['state_dict']` ({change}); "
    "megatrain loads the weights from the checkpoint folder into its store, so the change would be lost, "
    "and nothing was loaded. There `checkpoint['state_dict']` holds each weight's name, shape and dtype "
    "(meta tensors), not its values. Change the weights after the checkpoint is loaded (e.g. in "
    "`on_train_start`), or edit a single-file copy (`megatrain convert CKPT OUT.ckpt`) and resume from it."
)


@dataclass(frozen=True)
class HandedStateDict:
    """A shallow copy of the ``state_dict`` handed to the hooks, to compare with what they leave."""

    entries: dict[str, Any]

    @classmethod
    def of(cls, state_dict: Mapping[str, Any]) -> HandedStateDict:
        return cls(dict(state_dict))

    def check_saved(self, now: Any) -> None:
        if change := self._change(now):
            raise MisconfigurationException(_SAVED.format(change=change))

    def check_loaded(self, now: Any) -> None:
        if change := self._change(now):
            raise MisconfigurationException(_LOADED.format(change=change))

    def _change(self, now: Any) -> str:
        """The entries removed, added and replaced (another object under the name), or ``""``."""
        if not isinstance(now, Mapping):
            return f"it is now a {type(now).__name__}"
        given = self.entries
        changes = {
            "removed": [name for name in given if name not in now],
            "added": [name for name in now if name not in given],
            "replaced": [name for name, value in given.items() if name in now and now[name] is not value],
        }
        return "; ".join(f"{what} {_names(names)}" for what, names in changes.items() if names)


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(name) for name in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def meta_state_dict(ckpt: CheckpointDir) -> dict[str, Tensor]:
    """The module's ``state_dict`` the checkpoint holds, each entry a meta tensor of the saved shape and
    dtype: what the load hooks can read without the weights being read into RAM."""
    return ckpt.state_dict(lambda entry: torch.empty(entry.shape, dtype=entry.dtype, device="meta"))
