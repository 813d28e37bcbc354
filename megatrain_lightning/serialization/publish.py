"""Directories published whole: written under ``<target>.tmp-<pid>``, then renamed into place, so a
crash never leaves something that looks complete but is not. An existing directory is replaced by an
atomic swap where the kernel has one (Linux); elsewhere by two renames, and a crash between them leaves
the previous one at ``<target>.old-<pid>``. :func:`recover` moves that back and removes what dead
processes left, before the next save or load of ``<target>``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from megatrain_lightning.engine.chaos import point
from megatrain_lightning.serialization.safetensors_io import ShardWriter, sha256_file
from megatrain_lightning.telemetry.progress import byte_progress, finish

FORMAT = "megatrain-checkpoint"
MANIFEST = "manifest.json"
LIGHTNING_STATE = "lightning.pt"


class CheckpointIOError(OSError):
    """Reading or writing a checkpoint failed; the message names the file and what to do."""


def io_failure(err: OSError, path: str, writing: bool) -> CheckpointIOError:
    """A clear error for a checkpoint file that could not be read or written (nothing was published or
    loaded: the previous checkpoint is unchanged)."""
    file = err.filename or path
    if err.errno == errno.ENOSPC:
        hint = f"free space on the disk holding {path} or save checkpoints elsewhere"
    else:
        hint = f"check the disk holding {path}"
    what = f"writing the checkpoint {path}" if writing else f"reading the checkpoint {path}"
    unchanged = "the previous checkpoint there is unchanged" if writing else "the checkpoint is unchanged"
    return CheckpointIOError(
        err.errno, f"megatrain: {what} failed at {file}: {err.strerror or err}; {hint} ({unchanged})."
    )


def recover(target: str) -> None:
    """Undo what a process killed while saving ``target`` left: the previous checkpoint moved aside by
    ``replace_dir`` is moved back, and the partial copies of dead processes are removed."""
    target = os.fspath(target).rstrip(os.sep)
    for leftover in sorted(
        glob.glob(f"{glob.escape(target)}.old-*") + glob.glob(f"{glob.escape(target)}.tmp-*")
    ):
        if _alive(leftover.rsplit("-", 1)[1]):
            continue
        if leftover.startswith(f"{target}.old-") and not os.path.lexists(target):
            os.rename(leftover, target)
        else:
            remove_entry(leftover)


def _alive(pid: str) -> bool:
    """Whether the process that named a leftover ``pid`` may still be writing it (this one is not)."""
    if not pid.isdigit():
        return True  # not ours: left alone
    if int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder holding a megatrain checkpoint's manifest."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def check_replaceable(target: str) -> None:
    """Refuse to publish over a folder that is neither empty nor a megatrain checkpoint: it is the user's
    (Lightning's default strategy refuses to save over a folder too). A file is replaced, as Lightning
    overwrites a checkpoint file."""
    if os.path.isdir(target) and os.listdir(target) and not is_checkpoint_dir(target):
        raise CheckpointIOError(
            errno.EEXIST,
            f"megatrain: {target} is a folder that is not a megatrain checkpoint; nothing was written and "
            "it is left as it was. Save the checkpoint to another path.",
        )


def replace_dir(new: str, target: str) -> None:
    """Move the complete directory ``new`` to ``target``, replacing what was there: in one step where the
    kernel swaps two paths (Linux ``renameat2``), else in two renames (see :func:`recover`)."""
    if not os.path.lexists(target):
        os.rename(new, target)
        return
    point("ckpt.replace", target)
    if _exchange(new, target):  # ``new`` now names the previous entry
        remove_entry(new)
        return
    old = f"{target.rstrip(os.sep)}.old-{os.getpid()}"
    os.rename(target, old)
    point("ckpt.replace", target)
    os.rename(new, target)
    remove_entry(old)


def remove_entry(path: str) -> None:
    """Remove a directory tree, or a file or link (a link is removed, not what it points to)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _exchange(a: str, b: str) -> bool:
    """Swap paths ``a`` and ``b`` atomically; ``False`` where the system or the filesystem cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), b)


class CheckpointWriter:
    """Collects the files of one checkpoint under a temporary name, then publishes them."""

    def __init__(self, path: str, tmp: str | None = None, expected_bytes: int = 0) -> None:
        """``tmp``: join the temporary directory another process opened (a data-parallel save's rank 0),
        writing files for it to publish; without, open one. ``expected_bytes``: this writer's share, for
        its progress bar."""
        self.path = os.fspath(path).rstrip(os.sep)
        self.tmp = tmp or f"{self.path}.tmp-{os.getpid()}"
        if tmp is None:
            recover(self.path)
            check_replaceable(self.path)
            for sub in ("model", "optimizer"):
                os.makedirs(os.path.join(self.tmp, sub))
        self.files: dict[str, dict[str, Any]] = {}
        self.manifest: dict[str, Any] = {"format": FORMAT, "version": 1}
        self.progress = byte_progress(expected_bytes, f"saving {os.path.basename(self.path)}")

    def shard(self, relpath: str, tensors: dict[str, Tensor]) -> None:
        with self.stream(relpath, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]) as writer:
            for name, tensor in tensors.items():
                writer.write(name, tensor)

    @contextlib.contextmanager
    def stream(
        self, relpath: str, declared: list[tuple[str, torch.dtype, tuple[int, ...]]]
    ) -> Iterator[ShardWriter]:
        """A safetensors file of the ``declared`` tensors, their bytes appended in pieces by the caller."""
        point("ckpt.write", os.path.join(self.tmp, relpath))
        writer = ShardWriter(os.path.join(self.tmp, relpath), declared)
        try:
            yield writer
        except BaseException:
            writer.abandon()
            raise
        self._record(relpath, writer.close())

    def text(self, relpath: str, content: str) -> None:
        point("ckpt.write", os.path.join(self.tmp, relpath))
        with open(os.path.join(self.tmp, relpath), "w") as f:
            f.write(content)
        self._record(relpath, sha256_file(os.path.join(self.tmp, relpath)))

    def lightning_state(self, state: dict[str, Any]) -> None:
        path = os.path.join(self.tmp, LIGHTNING_STATE)
        point("ckpt.write", path)
        torch.save(state, path)
        self._record(LIGHTNING_STATE, sha256_file(path))

    def publish(self) -> None:
        self.manifest["files"] = self.files
        path = os.path.join(self.tmp, MANIFEST)
        point("ckpt.write", path)
        with open(path, "w") as f:
            json.dump(self.manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        replace_dir(self.tmp, self.path)
        finish(self.progress)

    def abandon(self) -> None:
        """Remove the partial copy of a failed save."""
        self.progress.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _record(self, relpath: str, sha256: str) -> None:
        size = os.path.getsize(os.path.join(self.tmp, relpath))
        self.files[relpath] = {"bytes": size, "sha256": sha256}
        self.progress.update(size)
