"""Byte-level text data: a tokenizer, a window dataset and a Lightning data module.

The shipped corpus (``megatrain_lightning/data/tiny_corpus.txt``, written by
``scripts/make_corpus.py``) is small synthetic English; any ``.txt`` file or ``.jsonl`` file with a
``"text"`` field per line works too. Tokens are raw UTF-8 bytes, so no tokenizer files are needed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

SHIPPED_CORPUS = "tiny_corpus.txt"
_EXTENSIONS = (".txt", ".jsonl")


class ByteTokenizer:
    """Tokens are the UTF-8 bytes of the text: vocabulary 256, no special tokens."""

    vocab_size: int = 256

    def encode(self, text: str) -> torch.Tensor:
        """Return the UTF-8 bytes of ``text`` as a 1-D ``LongTensor``."""
        data = text.encode("utf-8")
        if not data:
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """Return the text of byte ids; invalid UTF-8 (e.g. from sampling) becomes U+FFFD."""
        if isinstance(ids, torch.Tensor):
            ids = ids.flatten().tolist()
        return bytes(ids).decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return self.vocab_size


class EpochShuffle(Sampler[int]):
    """A permutation drawn from ``(seed, epoch)``: Lightning calls ``set_epoch``, so a run resumed at an
    epoch boundary sees exactly the batches the uninterrupted run saw."""

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.size, generator=generator).tolist())


class TokenWindowDataset(Dataset):
    """Non-overlapping windows of ``seq_len`` tokens; a trailing partial window is dropped.

    Each item is ``{"input_ids": LongTensor[seq_len], "labels": LongTensor[seq_len]}`` with equal
    tensors: Hugging Face causal LMs shift the labels themselves.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D tensor, got shape {tuple(tokens.shape)}")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return self.tokens.numel() // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        index %= len(self)
        window = self.tokens[index * self.seq_len : (index + 1) * self.seq_len].long()
        return {"input_ids": window, "labels": window.clone()}


def shipped_corpus_path() -> Path:
    """Path of the corpus that ships inside the package."""
    return Path(str(resources.files("megatrain_lightning") / "data" / SHIPPED_CORPUS))


def read_corpus(path: str | Path) -> str:
    """Read a ``.txt`` file, or the ``"text"`` fields of a ``.jsonl`` file joined by newlines."""
    path = Path(path)
    if path.suffix not in _EXTENSIONS:
        raise ValueError(f"unsupported corpus file {str(path)!r}: expected a .txt or .jsonl file")
    if not path.is_file():
        raise FileNotFoundError(f"corpus file not found: {str(path)!r}")
    if path.suffix == ".txt":
        return path.read_text(encoding="utf-8")
    texts = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f'{path}:{lineno}: JSON line has no string "text" field')
            texts.append(record["text"])
    return "\n".join(texts)


class TextDataModule(L.LightningDataModule):
    """Byte-tokenized text split into a train part and a held-out tail.

    The last ``val_fraction`` of the tokens is the validation split; ``test`` and ``predict``
    use that split too. The train loader shuffles with a generator seeded by ``seed``, so two
    runs see batches in the same order; the other loaders do not shuffle.

    Args:
        path: A ``.txt`` or ``.jsonl`` file (``{"text": ...}`` per line); ``None`` for the
            corpus shipped with the package.
        seq_len: Tokens per sample.
        batch_size: Samples per batch.
        val_fraction: Share of the tokens held out for validation, in ``(0, 1)``.
        num_workers: ``DataLoader`` worker processes.
        seed: Seed of the train loader's shuffling.
    """

    def __init__(
        self,
        path: str | None = None,
        seq_len: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if path is not None:
            suffix = Path(path).suffix
            if suffix not in _EXTENSIONS:
                raise ValueError(f"unsupported corpus file {path!r}: expected a .txt or .jsonl file")
            if not Path(path).is_file():
                raise FileNotFoundError(f"corpus file not found: {path!r}")
        self.save_hyperparameters()
        self.path = path
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.seed = seed
        self.tokenizer = ByteTokenizer()
        self.train_set: TokenWindowDataset | None = None
        self.val_set: TokenWindowDataset | None = None

    @property
    def corpus_path(self) -> Path:
        return shipped_corpus_path() if self.path is None else Path(self.path)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        tokens = self.tokenizer.encode(read_corpus(self.corpus_path)).to(torch.uint8)
        n_val = int(tokens.numel() * self.val_fraction)
        n_train = tokens.numel() - n_val
        if n_train < self.seq_len or n_val < self.seq_len:
            need = int(self.seq_len / min(self.val_fraction, 1 - self.val_fraction)) + 1
            raise ValueError(
                f"corpus {str(self.corpus_path)!r} is too short: {tokens.numel()} tokens give "
                f"{n_train} train and {n_val} validation tokens, but each split needs at least one "
                f"window of seq_len={self.seq_len} (about {need} tokens in all at "
                f"val_fraction={self.val_fraction})"
            )
        self.train_set = TokenWindowDataset(tokens[:n_train], self.seq_len)
        self.val_set = TokenWindowDataset(tokens[n_train:], self.seq_len)

    def _loader(self, dataset: TokenWindowDataset | None, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("TextDataModule.setup() must run before its dataloaders are requested")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=EpochShuffle(len(dataset), self.seed) if shuffle else None,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)
