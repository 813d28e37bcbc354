"""The disk tier's folder: one preallocated file per kind of block data (``param.bin``, ``exp_avg.bin``,
...) with each chunk of each block at a page-aligned offset, the ``manifest.json`` that describes them,
and the lock that keeps two runs out of one folder.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable

from megatrain_lightning.store.io import BlockFile, IOConfig, StoreIOError
from megatrain_lightning.store.layout import Block
from megatrain_lightning.store.memory import ALIGNMENT, pages
from megatrain_lightning.store.preflight import remove_empty_dirs

STORE_DIRNAME = "megatrain_store"
# Gradient sums reach the disk only when the cache must evict them before their update used them: their
# files are sparse (space taken as written), so a run without accumulation needs no room for them.
SPARSE_KINDS = frozenset({"grad", "grad_pass"})


class StoreFiles:
    """The files of one store, by kind, created on a kind's first use."""

    def __init__(
        self, directory: str, io: IOConfig, blocks: list[Block], chunks: list[list[tuple[int, int]]]
    ) -> None:
        self.directory, self.io, self.blocks, self.chunks = directory, io, blocks, chunks
        self.files: dict[str, BlockFile] = {}
        self.offsets: dict[str, list[list[int]]] = {}  # kind -> block -> chunk -> file offset

    def open(self, kind: str, chunk_bytes: Callable[[int, int], int]) -> BlockFile:
        """``kind``'s file, made on first use with room for every chunk (``chunk_bytes(block, chunk)``)."""
        if kind not in self.files:
            offsets, end = [], 0
            for block, spans in enumerate(self.chunks):
                offsets.append([])
                for chunk in range(len(spans)):
                    offsets[-1].append(end)
                    end += pages(chunk_bytes(block, chunk))
            path = os.path.join(self.directory, f"{kind}.bin")
            self.files[kind] = BlockFile(path, max(end, ALIGNMENT), self.io, sparse=kind in SPARSE_KINDS)
            self.offsets[kind] = offsets
        return self.files[kind]

    def release(self, key: tuple[int, str, int], nbytes: int) -> None:
        """The chunk ``key`` (block, kind, chunk) of ``nbytes`` on disk is no longer needed: a sparse file
        gives its space back."""
        block, kind, chunk = key
        self.files[kind].release(self.offsets[kind][block][chunk], pages(nbytes))

    def write_manifest(self) -> None:
        manifest = {
            "format": 1,
            "blocks": [
                {
                    "name": b.name,
                    "numel": b.numel,
                    "chunks": self.chunks[b.index],
                    "params": [[p.name, list(p.shape), p.offset] for p in b.params],
                }
                for b in self.blocks
            ],
            "files": {kind: {"path": f"{kind}.bin", "offsets": self.offsets[kind]} for kind in self.files},
        }
        path = os.path.join(self.directory, "manifest.json")
        with open(path + ".tmp", "w") as f:
            json.dump(manifest, f, indent=1)
        os.replace(path + ".tmp", path)


def lock_directory(directory: str) -> int:
    """Hold ``directory`` for this process (a lock file naming it), or say who holds it; remove what an
    earlier holder left there: a killed run's files are never read (a block reads as zeros until this
    store writes it), only their space is taken back. The lock is an ``flock``: the kernel releases a dead
    holder's."""
    fd = os.open(os.path.join(directory, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as err:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        if owner == f"pid {os.getpid()}":
            owner = "another model of this process (a store lives as long as its model: `del` that one)"
        raise StoreIOError(
            err.errno, f"megatrain: {directory} is in use by {owner}; give each run its own `offload_dir`."
        ) from err
    for name in os.listdir(directory):
        if name != "lock":
            os.remove(os.path.join(directory, name))
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
    return fd


def close_files(
    files: dict[str, BlockFile], lock_fd: int, directory: str, keep: bool, made_dirs: list[str]
) -> None:
    """Close a store's files and remove its folder unless ``keep``, then the folders made for it that are
    empty now (``made_dirs``, innermost first); then let go of the folder."""
    for file in files.values():
        file.close()
    if not keep:
        shutil.rmtree(directory, ignore_errors=True)
        remove_empty_dirs(made_dirs)
    os.close(lock_fd)
