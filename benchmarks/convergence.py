"""Loss curves of fp32, int8 and int4 optimizer state on the shipped corpus, side by side.

Run: ``python benchmarks/convergence.py [--steps 300 --lr 1e-3]``. Trains the tiny Llama three
times from the same weights and batches (megatrain strategy, CPU), prints the mean loss of the
last 20 steps of each and its difference to fp32, and writes ``benchmarks/convergence.png``.
"""

from __future__ import annotations

import argparse
import copy
import logging
import warnings
from pathlib import Path

import lightning as L
import matplotlib
import torch
from transformers import AutoModelForCausalLM

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.data import TextDataModule
from megatrain_lightning.models import CausalLMModule
from megatrain_lightning.presets import tiny_config

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


class Losses(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(float(outputs["loss"]))


def curve(model: torch.nn.Module, compression: str, steps: int, lr: float) -> list[float]:
    losses = Losses()
    trainer = L.Trainer(
        strategy=MegaTrainStrategy(optimizer_compression=compression),
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[losses],
    )
    module = CausalLMModule(copy.deepcopy(model), lr=lr, warmup_steps=2, max_steps=steps)
    torch.manual_seed(1)
    trainer.fit(module, datamodule=TextDataModule(seq_len=64, batch_size=8))
    return losses.values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", default=str(Path(__file__).with_name("convergence.png")))
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    curves = {c: curve(model, c, args.steps, args.lr) for c in ("none", "int8", "int4")}
    final = {c: sum(v[-20:]) / 20 for c, v in curves.items()}
    for c, value in final.items():
        change = (value / final["none"] - 1) * 100
        print(f"{c:>5}: final loss (mean of last 20 steps) {value:.4f}  ({change:+.2f}% vs none)")
    fig, ax = plt.subplots(figsize=(7, 4))
    for c, values in curves.items():
        ax.plot(values, label=f"{c} (final {final[c]:.3f})", linewidth=1)
    ax.set(xlabel="optimizer step", ylabel="training loss", title=f"tiny Llama, shipped corpus, lr {args.lr}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
