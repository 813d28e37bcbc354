"""Tests of the byte tokenizer, the window dataset and the text data module."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from megatrain_lightning.data import (
    ByteTokenizer,
    TextDataModule,
    TokenWindowDataset,
    read_corpus,
    shipped_corpus_path,
)

REPO = Path(__file__).resolve().parents[1]


def _batches(loader, n=3):
    it = iter(loader)
    return [next(it)["input_ids"] for _ in range(n)]


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "three plus four is seven.\nnaïve café ✓ 🙂"
    ids = tok.encode(text)
    assert ids.dtype == torch.long and ids.ndim == 1
    assert ids.numel() == len(text.encode("utf-8"))
    assert int(ids.min()) >= 0 and int(ids.max()) < tok.vocab_size == len(tok) == 256
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text
    assert tok.encode("").numel() == 0
    # Invalid UTF-8 (e.g. a sampled byte sequence) decodes with a replacement character.
    assert tok.decode([0xFF, ord("a")]) == "\ufffda"


def test_windows_are_non_overlapping_with_equal_labels():
    tokens = torch.arange(103)
    ds = TokenWindowDataset(tokens, seq_len=10)
    assert len(ds) == 10  # the trailing 3 tokens are dropped
    for i in range(len(ds)):
        item = ds[i]
        assert item["input_ids"].shape == (10,) and item["input_ids"].dtype == torch.long
        assert torch.equal(item["input_ids"], torch.arange(10 * i, 10 * i + 10))
        assert torch.equal(item["labels"], item["input_ids"])
    assert torch.equal(ds[-1]["input_ids"], ds[9]["input_ids"])
    with pytest.raises(IndexError):
        ds[10]
    with pytest.raises(ValueError, match="seq_len"):
        TokenWindowDataset(tokens, seq_len=0)


def test_shipped_corpus_is_what_the_script_writes():
    path = shipped_corpus_path()
    text = path.read_text(encoding="utf-8")
    assert 250_000 <= len(text.encode()) <= 350_000
    spec = importlib.util.spec_from_file_location("make_corpus", REPO / "scripts" / "make_corpus.py")
    make_corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_corpus)
    assert make_corpus.make_corpus() == text
    assert " plus " in text and "once upon a time" in text


def test_datamodule_shapes_and_split():
    dm = TextDataModule(seq_len=64, batch_size=4)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (4, 64) and batch["labels"].shape == (4, 64)
    n_tokens = len(shipped_corpus_path().read_bytes())
    assert len(dm.val_set) == int(n_tokens * 0.05) // 64
    assert len(dm.train_set) == (n_tokens - int(n_tokens * 0.05)) // 64
    # The validation split is the held-out tail, not part of the training tokens.
    assert dm.train_set.tokens.numel() + dm.val_set.tokens.numel() == n_tokens


def test_loaders_are_deterministic():
    def make(seed):
        dm = TextDataModule(seq_len=32, batch_size=4, seed=seed)
        dm.setup("fit")
        return dm

    a, b, c = make(0), make(0), make(1)
    for x, y in zip(_batches(a.train_dataloader()), _batches(b.train_dataloader()), strict=True):
        assert torch.equal(x, y)
    # A fresh loader from the same module starts the same shuffled order again.
    for x, y in zip(_batches(a.train_dataloader()), _batches(a.train_dataloader()), strict=True):
        assert torch.equal(x, y)
    assert not all(
        torch.equal(x, y)
        for x, y in zip(_batches(a.train_dataloader()), _batches(c.train_dataloader()), strict=True)
    )
    # Evaluation loaders walk the held-out windows in order.
    for loader in (a.val_dataloader(), a.test_dataloader(), a.predict_dataloader()):
        first = next(iter(loader))["input_ids"]
        expected = torch.stack([a.val_set[i]["input_ids"] for i in range(4)])
        assert torch.equal(first, expected)


def test_txt_and_jsonl_files(tmp_path):
    txt = tmp_path / "c.txt"
    txt.write_text("abcdefgh" * 50, encoding="utf-8")
    dm = TextDataModule(str(txt), seq_len=8, batch_size=2, val_fraction=0.1)
    dm.setup()
    assert ByteTokenizer().decode(dm.train_set[0]["input_ids"]) == "abcdefgh"

    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": f"line {i}", "id": i}) for i in range(40)) + "\n\n")
    assert read_corpus(jsonl).startswith("line 0\nline 1\n")
    dm = TextDataModule(str(jsonl), seq_len=8, batch_size=2, val_fraction=0.2)
    dm.setup()
    assert len(dm.train_set) > 0 and len(dm.val_set) > 0


def test_bad_inputs_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="corpus file not found: .*missing.txt"):
        TextDataModule(str(tmp_path / "missing.txt"))
    csv = tmp_path / "c.csv"
    csv.write_text("a,b\n")
    with pytest.raises(ValueError, match=r"unsupported corpus file .*c\.csv.*\.txt or \.jsonl"):
        TextDataModule(str(csv))

    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text('{"text": "fine"}\n{"body": "no text here"}\n')
    dm = TextDataModule(str(jsonl), seq_len=4)
    with pytest.raises(ValueError, match=r'bad\.jsonl:2: JSON line has no string "text" field'):
        dm.setup()
    jsonl.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        read_corpus(jsonl)

    short = tmp_path / "short.txt"
    short.write_text("only a few bytes")
    dm = TextDataModule(str(short), seq_len=128)
    with pytest.raises(ValueError, match=r"too short: 16 tokens.*seq_len=128"):
        dm.setup()

    with pytest.raises(ValueError, match="val_fraction"):
        TextDataModule(val_fraction=0.0)
    with pytest.raises(ValueError, match="batch_size"):
        TextDataModule(batch_size=0)
