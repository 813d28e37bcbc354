"""Every command and code block of the README, run as written in one working folder, in README order.

Settings are shortened (2 optimizer steps, 32-token windows, a shrunken ``llama_170m``) and runs get
folders of their own (``hydra.run.dir``), so the README's placeholders resolve: ``outputs/DATE/TIME``
is the quick start's run, ``/path/to/hf_model`` a tiny saved model, ``corpus.jsonl`` a file here.
Skipped, with the reason: installs (``.ci/run`` runs them on a fresh machine), ``pytest`` (this
suite), and what needs a GPU or an optional extra that is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from entry_points import run_command

from megatrain_lightning import hf_trainer
from megatrain_lightning.data import read_corpus, shipped_corpus_path

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
HYDRA_SHORT = {
    "trainer.max_steps": "2",
    "data.seq_len": "32",
    "data.batch_size": "2",
    "trainer.val_check_interval": "2",
    "trainer.limit_val_batches": "1",
}
# llama_170m at a tiny width: the same config path (llama_config with overrides), seconds not minutes.
SHRINK_LLAMA = [
    f"+model.model.{k}={v}"
    for k, v in dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, vocab_size=256
    ).items()
]
CLI_SHORT = ["--trainer.limit_val_batches=1", "--data.seq_len=32", "--data.batch_size=2"]
PYTHON_SHORT = {
    r"max_steps=\d+": "max_steps=2",
    r"accumulate_grad_batches=\d+": "accumulate_grad_batches=2",
    r"gradient_accumulation_steps=\d+": "gradient_accumulation_steps=2",
}


def readme_items() -> list[tuple[str, str]]:
    """``("bash", one command)`` per command line and ``("python", code)`` per block, in order."""
    items = []
    for lang, body in BLOCK.findall((REPO / "README.md").read_text()):
        if lang == "python":
            items.append(("python", body))
        elif lang == "bash":
            items += [("bash", line.strip()) for line in body.splitlines() if line.strip()]
    return items


ITEMS = readme_items()
QUICK_START = next(i for i, (lang, text) in enumerate(ITEMS) if text == "megatrain-train")


def _id(index: int, item: tuple[str, str]) -> str:
    lang, text = item
    head = (
        text if lang == "bash" else next(line for line in text.splitlines() if line and "import" not in line)
    )
    return f"{index:02d}-{re.sub(r'[^A-Za-z0-9_.=-]+', '_', head)[:60]}"


def _skip_reason(argv: list[str]) -> str | None:
    if argv[:2] == ["pip", "install"]:
        return "installs packages: .ci/run runs the README's install on a fresh machine"
    if argv[0] == "pytest":
        return "runs the test suite, this file included"
    if "trainer=gpu" in argv and not torch.cuda.is_available():
        return "needs a GPU"
    if any("tensorboard" in a for a in argv) and importlib.util.find_spec("tensorboard") is None:
        return 'needs the tensorboard extra (pip install "megatrain-lightning[tensorboard]")'
    return None


def _set(argv: list[str], key: str, value: str) -> list[str]:
    """``key=value`` replacing an existing ``key=...`` override, else appended."""
    out = [a for a in argv if not a.startswith(f"{key}=")]
    return [*out, f"{key}={value}"]


def _shorten(index: int, argv: list[str]) -> list[str]:
    program = argv[0]
    if program == "megatrain-train" or argv[:2] == ["python", "examples/train.py"]:
        for key, value in HYDRA_SHORT.items():
            argv = _set(argv, key, value)
        if any(a.startswith("ckpt_path=") for a in argv):
            argv = _set(argv, "trainer.max_steps", "4")  # 2 steps restored, 2 more
        if "model=llama_170m" in argv:
            argv += SHRINK_LLAMA
        multirun = "--multirun" in argv or "-m" in argv
        return _set(argv, "hydra.sweep.dir" if multirun else "hydra.run.dir", f"outputs/cmd{index}")
    if program == "megatrain" and argv[1:2] and argv[1] in ("fit", "validate", "test", "predict"):
        steps = "4" if "--ckpt_path" in argv else "2"
        return [*argv, f"--trainer.max_steps={steps}", *CLI_SHORT]
    return argv


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A fresh folder holding what the README's commands refer to: its configs, examples and inputs."""
    from transformers import AutoModelForCausalLM

    from megatrain_lightning.presets import tiny_config

    root = tmp_path_factory.mktemp("readme")
    shutil.copytree(REPO / "configs", root / "configs")
    shutil.copytree(REPO / "examples", root / "examples")
    lines = read_corpus(shipped_corpus_path()).splitlines()[:200]
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(root / "hf_model")
    return root


@pytest.fixture
def in_workdir(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    yield workdir
    hf_trainer.init()  # the mt.init of a README block applies to later Trainers of this process


@pytest.mark.parametrize(
    ("index", "item"), list(enumerate(ITEMS)), ids=[_id(i, it) for i, it in enumerate(ITEMS)]
)
def test_readme(index, item, in_workdir):
    lang, text = item
    text = text.replace("outputs/DATE/TIME", f"outputs/cmd{QUICK_START}")
    text = text.replace("/path/to/hf_model", str(in_workdir / "hf_model"))
    if lang == "python":
        for pattern, replacement in PYTHON_SHORT.items():
            text = re.sub(pattern, replacement, text)
        exec(compile(text, f"README.md block {index}", "exec"), {"__name__": "__readme__"})
        return
    argv = shlex.split(text, comments=True)
    reason = _skip_reason(argv)
    if reason:
        pytest.skip(reason)
    if index > QUICK_START and "outputs/cmd" in text:
        assert (in_workdir / f"outputs/cmd{QUICK_START}").is_dir(), (
            "run the whole file: needs the quick start's run"
        )
    argv = _shorten(index, argv)
    assert run_command(argv) == 0, shlex.join(argv)
    if index == QUICK_START:
        run = in_workdir / f"outputs/cmd{index}"
        assert (run / "lightning_logs/version_0/checkpoints/last.ckpt").is_dir()
        assert "final train_loss:" in (run / "train.log").read_text()


def test_what_works_lists_the_zoo_and_names_existing_tests():
    """The README's "What works": its architectures are the zoo's, and every test it names exists."""
    from zoo import readme_section

    readme = (REPO / "README.md").read_text()
    start, end = "-->\n", "\n<!-- /zoo -->"
    section = readme.split("<!-- zoo:", 1)[1].split(start, 1)[1].split(end, 1)[0]
    assert section.strip() == readme_section(), f"paste this between the zoo markers:\n{readme_section()}"
    table = readme.split("## What works", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(test_\w+)`", table))
    defined = {
        m
        for path in (REPO / "tests").glob("test_*.py")
        for m in re.findall(r"^def (test_\w+)", path.read_text(), re.M)
    }
    assert named and named <= defined, f"not tests: {sorted(named - defined)}"
