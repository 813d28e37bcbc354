"""Progress of long work outside the training loop (saving, checking, exporting, converting a checkpoint)
as the tqdm bar Lightning users know: bytes done, the rate and an ETA. Work that takes about a second
or less shows none, and only rank 0 shows one."""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_only

SHOWN_FROM_BYTES = 1 << 30  # about a second of disk work: less is not waited for


def byte_progress(total: int, description: str) -> Any:
    """A tqdm bar over about ``total`` bytes (a context manager; ``update(nbytes)``, :func:`finish`),
    disabled for less than :data:`SHOWN_FROM_BYTES` and off rank 0."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc=description,
        unit="B",
        unit_scale=True,
        dynamic_ncols=True,
        disable=total < SHOWN_FROM_BYTES or rank_zero_only.rank != 0,
    )


def finish(progress: Any) -> None:
    """Close a bar at 100% of what was done: the bytes written (file headers, pickled state) differ a little
    from the tensors' bytes it was sized by."""
    progress.total = progress.n
    progress.close()
