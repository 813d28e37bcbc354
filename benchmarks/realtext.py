"""Real text every machine has: the Python standard library's own source files, byte-level.

Nobody here wrote it and nothing is downloaded: the ``.py`` files directly under
``sysconfig.get_paths()["stdlib"]``, sorted by name. Whole files are held out for validation (every
``val_every``-th file), so validation text is never a neighbour of training text.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch import Tensor


def stdlib_files() -> list[Path]:
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def stdlib_tokens(val_every: int = 10) -> tuple[Tensor, Tensor]:
    """(train, validation) byte tokens (int64)."""
    train, val = [], []
    for i, path in enumerate(stdlib_files()):
        (val if i % val_every == val_every - 1 else train).append(path.read_bytes())
    as_tokens = lambda parts: torch.frombuffer(bytearray(b"\n".join(parts)), dtype=torch.uint8).long()  # noqa: E731
    return as_tokens(train), as_tokens(val)


def batches(tokens: Tensor, batch_size: int, seq_len: int, seed: int):
    """Endless random windows of ``seq_len`` tokens, in an order fixed by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=g)
        yield torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])


def fixed_batches(
    tokens: Tensor, count: int, batch_size: int, seq_len: int, seed: int = 1234
) -> list[Tensor]:
    """The same ``count`` validation batches for every run."""
    it = batches(tokens, batch_size, seq_len, seed)
    return [next(it) for _ in range(count)]


def all_windows(tokens: Tensor, seq_len: int) -> Tensor:
    """The whole split as consecutive, non-overlapping windows of ``seq_len`` tokens (the rest dropped)."""
    return tokens[: tokens.numel() // seq_len * seq_len].view(-1, seq_len)
