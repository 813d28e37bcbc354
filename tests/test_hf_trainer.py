"""`mt.init` + `mt.Trainer(model, args=TrainingArguments(...))`: the Hugging Face Trainer habit."""

from __future__ import annotations

import csv
import warnings

import pytest
import torch
from conftest import tiny_model
from lightning.fabric.utilities.exceptions import MisconfigurationException
from test_heads import HEADS
from transformers import AutoModelForCausalLM, TrainingArguments

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning import hf_trainer as mt
from megatrain_lightning.data import TextDataModule


class _InputsOnly(torch.utils.data.Dataset):
    """Dicts with input_ids only: the trainer derives the labels."""

    def __init__(self, windows: torch.utils.data.Dataset) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i]["input_ids"]}


@pytest.fixture(autouse=True)
def _reset_init():
    yield
    mt.init()


@pytest.fixture(scope="module")
def windows():
    dm = TextDataModule(seq_len=32, batch_size=4)
    dm.setup()
    return dm


def test_trainer_maps_training_arguments_and_loss_falls(tmp_path, windows):
    mt.init(max_vram_gb=0.01, optimizer_compression="none", prefetch_depth=1)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=0.1,
        weight_decay=0.01,
        adam_beta2=0.98,
        max_grad_norm=1.0,
        max_steps=16,
        logging_steps=1,
        save_steps=8,
        eval_strategy="steps",
        eval_steps=8,
        seed=3,
        use_cpu=True,
        disable_tqdm=True,
        report_to=[],
    )
    trainer = mt.Trainer(
        model=tiny_model("llama"),
        args=args,
        train_dataset=_InputsOnly(windows.train_set),
        eval_dataset=windows.val_set,
    )
    out = trainer.train()

    lt = trainer.trainer
    strategy = lt.strategy
    assert isinstance(strategy, MegaTrainStrategy) and (strategy.max_vram_gb, strategy.prefetch_depth) == (
        0.01,
        1,
    )
    assert (lt.accumulate_grad_batches, lt.gradient_clip_val, lt.max_steps, lt.log_every_n_steps) == (
        2,
        1.0,
        16,
        1,
    )
    assert lt.val_check_batch == 16 and lt.precision == "32-true"
    assert out.global_step == 16 and 4.0 < out.training_loss < 5.6
    optimizer = lt.optimizers[0]
    assert (
        optimizer.param_groups[0]["betas"] == (0.9, 0.98)
        and optimizer.param_groups[0]["weight_decay"] == 0.01
    )
    assert optimizer.param_groups[1]["weight_decay"] == 0.0
    assert optimizer.param_groups[0]["lr"] < 1e-4  # cosine to 0 at step 16

    with open(tmp_path / "logs" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    lrs = {int(r["step"]): float(r["lr-AdamW/pg1"]) for r in rows if r.get("lr-AdamW/pg1")}
    assert len(losses) == 16 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    assert [lrs[step] for step in range(3)] == pytest.approx(
        [0.0, 1.5e-3, 3e-3]
    )  # linear warmup over 2 steps (10% of 16), then cosine
    assert sum(1 for r in rows if r.get("val_loss")) == 2
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("*.ckpt"))
    assert saved == ["checkpoint-16.ckpt", "checkpoint-8.ckpt", "last.ckpt"]

    # Hugging Face's `state.log_history`: per logging step the mean loss since the last entry and the step's
    # learning rate, each evaluation, a summary; then `evaluate()`'s entry.
    metrics = trainer.evaluate()
    assert set(metrics) == {"eval_loss", "eval_ppl"} and metrics["eval_loss"] < 5.0
    state = trainer.state
    assert (state.global_step, state.max_steps) == (16, 16)
    logged = [e for e in state.log_history if "loss" in e]
    assert [e["step"] for e in logged] == list(range(1, 17))
    assert sum(e["loss"] for e in logged) / 16 == pytest.approx(out.training_loss, rel=1e-6)
    assert [e["learning_rate"] for e in logged] == pytest.approx([lrs[e["step"] - 1] for e in logged])
    epochs = [e["epoch"] for e in state.log_history]
    assert epochs == sorted(epochs) and epochs[0] > 0
    evaluations = [(e["step"], e["eval_loss"]) for e in state.log_history if "eval_loss" in e]
    assert [step for step, _ in evaluations] == [8, 16, 16] and evaluations[-1][1] == metrics["eval_loss"]
    summary = next(e for e in state.log_history if "train_loss" in e)
    assert summary["train_loss"] == out.training_loss and summary["step"] == 16


def test_unsupported_arguments_warn_once_each(tmp_path):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        fp16=True,
        torch_compile=True,
        label_smoothing_factor=0.1,
        optim="adamw_8bit",
        report_to=["tensorboard"],
        eval_delay=2,
        metric_for_best_model="loss",
        save_only_model=True,
        train_sampling_strategy="group_by_length",
        logging_strategy="epoch",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mt.Trainer(model=tiny_model("llama"), args=args, compute_metrics=len)
    messages = [str(w.message) for w in caught if issubclass(w.category, mt.UnsupportedArgumentWarning)]
    names = ("fp16", "torch_compile", "label_smoothing_factor", "optim", "report_to", "eval_delay")
    names += ("metric_for_best_model", "save_only_model", "train_sampling_strategy", "logging_strategy")
    for name in names:
        assert sum(f"TrainingArguments.{name}=" in m for m in messages) == 1, (name, messages)
    assert sum("compute_metrics" in m for m in messages) == 1
    assert len(messages) == 11, messages


class _OwnLoss(mt.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(**inputs).loss * 2


def test_what_would_train_other_math_or_skip_asked_work_is_refused(tmp_path, windows):
    """A loss or optimizer of the user's that mt.Trainer would not run, evaluation it cannot run, a resume
    with nothing to resume from, a model that is not a causal LM: errors saying what to do (each trained on
    silently or crashed later before)."""
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])
    model, data = tiny_model("llama"), windows.train_set
    cases = [
        (lambda: _OwnLoss(model=model, args=args), "does not call `compute_loss`, which _OwnLoss overrides"),
        (
            lambda: mt.Trainer(
                model=model, args=args, optimizers=(torch.optim.SGD(model.parameters()), None)
            ),
            "does not take `optimizers`",
        ),
        (
            lambda: mt.Trainer(model=model, args=args, compute_loss_func=len),
            "does not take `compute_loss_func`",
        ),
        (lambda: mt.Trainer(model=model, args=args, eval_dataset={"a": data}), "not a dict of them"),
        (lambda: mt.Trainer(args=args, model_init=lambda: model), "does not take `model_init`"),
        (
            lambda: mt.Trainer(model=model, args=TrainingArguments(str(tmp_path), eval_strategy="steps")),
            "needs an eval_dataset",
        ),
        (
            lambda: mt.Trainer(
                model, TrainingArguments(str(tmp_path), lr_scheduler_type="reduce_lr_on_plateau")
            ),
            "reduce_lr_on_plateau",
        ),
        (
            lambda: mt.Trainer(model=model, args=args, train_dataset=data).train(resume_from_checkpoint=True),
            "no checkpoint to resume from",
        ),
        (  # its perplexity would shift T5's labels as a causal LM's
            lambda: mt.Trainer(model=HEADS["t5"][0](), args=args, train_dataset=data),
            "trains causal language models .* T5ForConditionalGeneration is another kind",
        ),
        (  # its evaluation crashed, a vision model's batches lost their pixels
            lambda: mt.Trainer(model=HEADS["reward-model"][0](), args=args, train_dataset=data),
            "LlamaForSequenceClassification is another kind",
        ),
    ]
    for make, message in cases:
        with pytest.raises((MisconfigurationException, ValueError), match=message):
            make()


def test_save_strategy_no_saves_nothing_and_save_model_writes_the_trained_model(tmp_path, windows):
    args = TrainingArguments(
        str(tmp_path / "run"), max_steps=2, save_strategy="no", use_cpu=True, report_to=[], disable_tqdm=True
    )
    model = tiny_model("llama")
    trainer = mt.Trainer(model=model, args=args, train_dataset=windows.train_set)
    trainer.train()
    assert not list((tmp_path / "run").rglob("*.ckpt"))  # Lightning's own checkpointing saved one
    trainer.save_model(str(tmp_path / "model"))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    trained = model.state_dict()
    assert all(torch.equal(value, trained[name]) for name, value in saved.state_dict().items())


def test_an_optimizer_other_than_adamw_is_refused_and_low_bit_adamw_names_megatrains_option(tmp_path):
    with pytest.raises(MisconfigurationException, match="optim='sgd' is not AdamW.*optim='adamw_torch'"):
        mt.Trainer(
            model=tiny_model("llama"), args=TrainingArguments(str(tmp_path), use_cpu=True, optim="sgd")
        )
    args = TrainingArguments(str(tmp_path), use_cpu=True, optim="adamw_torch_4bit")
    with pytest.warns(
        mt.UnsupportedArgumentWarning, match=r"optimizer_compression='int4'\)`, and is fp32 now"
    ):
        mt.Trainer(model=tiny_model("llama"), args=args)
    mt.init(max_vram_gb=0.01, optimizer_compression="int4")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mt.Trainer(model=tiny_model("llama"), args=args)  # megatrain's int4 state: as asked
            for adamw in ("adamw_torch_fused", "paged_adamw_32bit"):
                mt.Trainer(model=tiny_model("llama"), args=TrainingArguments(str(tmp_path), optim=adamw))
    finally:
        mt.init()


def test_init_checks_options_at_once():
    with pytest.raises(MisconfigurationException, match="optimizer_compression"):
        mt.init(optimizer_compression="int1")
    with pytest.raises(MisconfigurationException, match="max_vram_gb"):
        mt.init(max_vram_gb=-1)
    with pytest.raises(ValueError, match="train_dataset"):
        mt.Trainer(
            model=tiny_model("llama"), args=TrainingArguments(output_dir="unused", use_cpu=True)
        ).train()


def test_short_bf16_run_on_cpu_logs_with_hf_defaults_and_resumes(tmp_path, windows):
    """The README's arguments on a CPU machine: bf16 with use_cpu, HF's logging_steps=500 on a 4-step run
    still logs, and train(resume_from_checkpoint=...) continues from the saved step. Checkpoints as
    Hugging Face's Trainer writes them: every save_steps and at the last step, none twice (Lightning's
    ModelCheckpoint alone saves the resumed step again at the first accumulated micro-batch, as
    checkpoint-4-v1, and not the last step 7)."""

    def args(steps: int) -> TrainingArguments:
        return TrainingArguments(
            str(tmp_path),
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=steps,
            bf16=True,
            use_cpu=True,
            save_strategy="steps",
            save_steps=2,
            report_to="none",
            disable_tqdm=True,
        )

    first = mt.Trainer(
        model=tiny_model(), args=args(4), train_dataset=windows.train_set, eval_dataset=windows.val_set
    )
    assert first.args.logging_steps == 500
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first.train()
    assert not [w for w in caught if "val_dataloader" in str(w.message)]  # eval_strategy "no": not evaluated
    assert first.trainer.precision == "bf16-mixed"
    with open(tmp_path / "logs" / "version_0" / "metrics.csv") as f:
        logged = [r for r in csv.DictReader(f) if r.get("train_loss")]
    assert len(logged) == 4  # every step: min(500, max(1, 4 // 10))
    resumed = mt.Trainer(model=tiny_model(), args=args(7), train_dataset=windows.train_set)
    out = resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoints" / "last.ckpt"))
    assert out.global_step == 7
    with open(tmp_path / "logs" / "version_1" / "metrics.csv") as f:
        assert len([r for r in csv.DictReader(f) if r.get("train_loss")]) == 3  # steps 4 to 6 only

    def saved_step(name: str) -> int:
        return torch.load(tmp_path / "checkpoints" / name / "lightning.pt", weights_only=True)["global_step"]

    saved = sorted((p.name for p in (tmp_path / "checkpoints").glob("*.ckpt")), key=lambda n: (len(n), n))
    assert saved == ["last.ckpt", *(f"checkpoint-{step}.ckpt" for step in (2, 4, 6, 7))]
    assert [saved_step(name) for name in saved] == [7, 2, 4, 6, 7]
    last = tmp_path / "checkpoints" / "last.ckpt"  # the newest, not a second copy of it
    assert last.is_symlink() and last.resolve() == (tmp_path / "checkpoints" / "checkpoint-7.ckpt").resolve()
