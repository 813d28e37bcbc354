"""Streaming safetensors: read tensors straight into the store, write shards from it.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
range) and the raw bytes. Reading with ``pread`` into the destination (not ``mmap``) keeps
resident memory at what the store holds; writing computes a SHA-256 of every byte as it goes,
so checkpoints carry checksums without a second read. Nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from megatrain_lightning.engine.chaos import point

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


class SafetensorsError(ValueError):
    """A safetensors file is missing, truncated or malformed; the message names the file."""


@dataclass(frozen=True)
class TensorEntry:
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return self.nbytes // self.dtype.itemsize


@dataclass(frozen=True)
class PiecedEntry:
    """A tensor saved in flat pieces across files (each rank's share of a data-parallel checkpoint):
    ``(first element, piece)`` pairs that tile the flattened tensor."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: tuple[tuple[int, TensorEntry], ...]

    @property
    def path(self) -> str:
        """The file of the first piece (for messages)."""
        return self.pieces[0][1].path if self.pieces else ""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def read_header(path: str) -> dict[str, TensorEntry]:
    """Index one safetensors file, checking that every byte range lies inside it."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise SafetensorsError(f"{path}: header length {length} exceeds the file ({size} bytes)")
            header = json.loads(f.read(length))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SafetensorsError(f"{path} is not a readable safetensors file: {err}") from err
    base = 8 + length
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            entry = TensorEntry(path, DTYPES[info["dtype"]], tuple(info["shape"]), base + begin, end - begin)
        except (KeyError, TypeError, ValueError) as err:
            raise SafetensorsError(f"{path}: malformed entry for {name!r}") from err
        numel = 1
        for d in entry.shape:
            numel *= d
        if entry.nbytes != numel * entry.dtype.itemsize or entry.start + entry.nbytes > size:
            raise SafetensorsError(f"{path} is truncated or corrupt: {name!r} does not fit in the file")
        entries[name] = entry
    return entries


def read_into(entry: TensorEntry | PiecedEntry, dst: Tensor) -> None:
    """Read one tensor into ``dst`` (contiguous, host, same shape), converting the dtype if needed."""
    if tuple(dst.shape) != entry.shape:
        raise SafetensorsError(
            f"{entry.path}: shape {entry.shape} is not the model's {tuple(dst.shape)}. A model changed after "
            "loading (`resize_token_embeddings` in `configure_model`) cannot be filled from these files: "
            "resize it in the LightningModule's `__init__`, or save the resized model once and load that."
        )
    read_elements(entry, 0, dst.view(-1))


def read_elements(entry: TensorEntry | PiecedEntry, start: int, dst: Tensor) -> None:
    """Elements ``[start, start + dst.numel())`` of the flattened tensor into ``dst`` (1-D, contiguous,
    host), converting the dtype if needed: a rank reads only its share of a block."""
    if start < 0 or start + dst.numel() > entry.numel:
        raise SafetensorsError(
            f"{entry.path}: elements {start}..{start + dst.numel()} are outside its {entry.numel}"
        )
    if isinstance(entry, PiecedEntry):
        stop = start + dst.numel()
        for first, piece in entry.pieces:
            a, b = max(start, first), min(stop, first + piece.numel)
            if a < b:
                read_elements(piece, a - first, dst[a - start : b - start])
        return
    target = dst if dst.dtype == entry.dtype else torch.empty(dst.numel(), dtype=entry.dtype)
    view = memoryview(target.view(torch.uint8).numpy())
    point("tensor.read", entry.path)
    with open(entry.path, "rb", buffering=0) as f:
        done = os.preadv(f.fileno(), [view], entry.start + start * entry.dtype.itemsize)
    if done != target.nbytes:
        raise SafetensorsError(f"{entry.path} is truncated: read {done} of {target.nbytes} bytes")
    if target is not dst:
        dst.copy_(target)


def read_tensor(entry: TensorEntry | PiecedEntry) -> Tensor:
    """One tensor, read into a new host tensor of its own dtype and shape."""
    tensor = torch.empty(entry.shape, dtype=entry.dtype)
    read_into(entry, tensor)
    return tensor


class ShardWriter:
    """One safetensors file written tensor by tensor (``write``), hashed as it goes."""

    def __init__(
        self,
        path: str,
        tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        header: dict = {"__metadata__": dict(metadata or {})}
        offset = 0
        self._layout = []
        self._starts: list[int] = []
        for name, dtype, shape in tensors:
            nbytes = dtype.itemsize
            for d in shape:
                nbytes *= d
            header[name] = dict(dtype=NAMES[dtype], shape=list(shape), data_offsets=[offset, offset + nbytes])
            self._layout.append((name, nbytes))
            self._starts.append(offset)
            offset += nbytes
        self._total = offset
        self._starts.append(offset)  # where each declared tensor starts in the data, then its end
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.path = path
        self._file = open(path, "wb")  # noqa: SIM115 (closed by ``close``, which returns the checksum)
        self._sha = hashlib.sha256()
        self._next = 0  # the first declared tensor not written whole
        self._filled = 0  # data bytes written
        self._emit(struct.pack("<Q", len(blob)) + blob)

    def write(self, name: str, tensor: Tensor) -> None:
        """Append ``name``'s bytes; tensors must come in the order they were declared."""
        expected, nbytes = self._layout[self._next] if self._next < len(self._layout) else (None, 0)
        if name != expected or tensor.nbytes != nbytes or self._filled != self._starts[self._next]:
            raise ValueError(f"{self.path}: expected {expected!r} ({nbytes} bytes), got {name!r}")
        self.append(tensor)

    def append(self, data: Tensor) -> None:
        """Append the next bytes of the declared tensors, in pieces of any size (a store chunk at a time:
        a block's weights never need to be in memory whole)."""
        view = memoryview(data.detach().contiguous().view(-1).view(torch.uint8).numpy())
        if self._filled + len(view) > self._total:
            raise ValueError(
                f"{self.path}: {self._filled + len(view) - self._total} bytes more than declared"
            )
        self._emit(view)
        self._filled += len(view)
        while self._next < len(self._layout) and self._starts[self._next + 1] <= self._filled:
            self._next += 1

    def close(self) -> str:
        """Flush to disk and return the file's SHA-256."""
        if self._filled != self._total:
            raise ValueError(f"{self.path}: {self._total - self._filled} declared bytes were never written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return self._sha.hexdigest()

    def abandon(self) -> None:
        """Close the file unfinished (the whole checkpoint directory is removed)."""
        self._file.close()

    def _emit(self, data: bytes | memoryview) -> None:
        self._sha.update(data)
        self._file.write(data)


def sha256_file(path: str, chunk: int = 16 << 20) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            sha.update(block)
    return sha.hexdigest()
