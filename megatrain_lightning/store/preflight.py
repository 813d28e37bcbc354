"""Checks that run before any work: each failure is a clear error saying what to change."""

from __future__ import annotations

import os
import shutil
import tempfile

import psutil
from lightning.fabric.utilities.exceptions import MisconfigurationException

_GB = 1e9
DISK_MARGIN = 0.05  # fraction of the store's size kept free beyond it
DISK_MARGIN_BYTES = 256 << 20


def free_disk_bytes(path: str) -> int:
    return shutil.disk_usage(path).free


def available_ram_bytes() -> int:
    return psutil.virtual_memory().available


def _refuse_a_file(path: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise MisconfigurationException(
            f"`offload_dir={path!r}` exists and is not a directory; choose another folder."
        )


def prepare_offload_dir(path: str) -> str:
    """Create ``path`` if needed and check that it is a writable directory."""
    path = os.path.abspath(path)
    _refuse_a_file(path)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        failed = f"{err.filename!r}: {err.strerror}" if err.filename else err.strerror
        raise MisconfigurationException(
            f"`offload_dir={path!r}` is not a writable directory and cannot be made one ({failed}); "
            "choose another folder."
        ) from None  # the message says what failed: the chained traceback would bury it
    return path


def check_offload_dir(path: str) -> None:
    """What :func:`prepare_offload_dir` would refuse, found without creating anything: ``path`` is not a
    directory, or the folder it would be created in is not writable."""
    path = os.path.abspath(path)
    _refuse_a_file(path)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise MisconfigurationException(
            f"`offload_dir={path!r}` is not a writable directory and cannot be made one ({existing!r} is "
            "not a writable folder); choose another folder."
        )


def missing_dirs(path: str) -> list[str]:
    """The folders that creating ``path`` makes, innermost first."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def remove_empty_dirs(dirs: list[str]) -> None:
    """Remove each of ``dirs`` (innermost first) that is empty, so a run leaves no empty folder."""
    for path in dirs:
        try:
            os.rmdir(path)
        except OSError:
            return


def with_margin(need_bytes: int) -> int:
    """The free disk space to ask for ``need_bytes`` of files: filesystems round up, other files grow."""
    return int(need_bytes * (1 + DISK_MARGIN)) + DISK_MARGIN_BYTES


def check_disk_space(path: str, need_bytes: int) -> None:
    want = with_margin(need_bytes)
    free = free_disk_bytes(path)
    if free < want:
        raise MisconfigurationException(
            f"megatrain's store needs {want / _GB:.2f} GB under `offload_dir={path!r}` (weights, gradients "
            f"and optimizer state, plus a margin) but only {free / _GB:.2f} GB are free. Free space or "
            "choose another `offload_dir`."
        )


def check_host_ram(max_cpu_gb: float, staging_bytes: int = 0) -> None:
    """``max_cpu_gb`` of cache, plus ``staging_bytes`` of page-locked gradient staging, fit in the RAM
    available."""
    available = available_ram_bytes()
    if max_cpu_gb * _GB + staging_bytes > available:
        staging = f" plus {staging_bytes / _GB:.2f} GB of gradient staging" if staging_bytes else ""
        raise MisconfigurationException(
            f"`max_cpu_gb={max_cpu_gb}`{staging} is more than the {available / _GB:.1f} GB of RAM available; "
            "lower it."
        )


def check_state_dict_fits(need_bytes: int) -> None:
    """A full state dict of the disk tier's weights (``need_bytes`` of fp32, read into RAM) fits in the RAM
    available; otherwise how to save and export them instead."""
    available = available_ram_bytes()
    if need_bytes > available:
        raise MisconfigurationException(
            f"The model's weights ({need_bytes / _GB:.2f} GB in fp32) live on disk under `offload_dir` and "
            f"do not fit in the {available / _GB:.2f} GB of RAM available, so no full state dict can be "
            "built. Save with `trainer.save_checkpoint(path)` (it streams the weights block by block) "
            "and export them with `megatrain_lightning.export_hf(path, out_dir)`."
        )
