"""Bytes of Adam state per parameter that megatrain's store actually holds, for each compression.

Run: ``python benchmarks/state_bytes.py [--hidden 512 --layers 8]`` (the defaults are the Llama of
``convergence.py``'s acceptance grid, 25.2M parameters; 15 seconds on two cores).

A LightningModule written the way users write one (the model's default call, ``torch.optim.AdamW``) takes
one step under ``Trainer(strategy=MegaTrainStrategy(optimizer_compression=...))``; then the store's
buffers of every optimizer-state kind are read back and their bytes counted: over the decoder layers
(where the large matrices get compressed state) and over the whole model (embeddings, head and norms keep
fp32 moments). Printed beside ``codecs.state_bytes``, what the format promises for a large tensor.
"""

from __future__ import annotations

import argparse
import logging
import warnings

import lightning as L
import torch
from convergence import make_model
from torch.utils.data import DataLoader

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.optim import codecs
from megatrain_lightning.optim.adamw import COMPRESSIONS


class UserLM(L.LightningModule):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def held_bytes(compression: str, hidden: int, layers: int) -> tuple[float, float]:
    """(decoder layers, whole model) bytes of optimizer state per parameter in the store after one step."""
    trainer = L.Trainer(
        strategy=MegaTrainStrategy(optimizer_compression=compression),
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    trainer.fit(UserLM(make_model(hidden, layers, seed=0)), DataLoader(tokens, batch_size=2))
    engine = trainer.strategy.engine
    kinds = engine.optimizer.state_kinds

    def per_param(blocks: list) -> float:
        held = sum(engine.store.read(b.index, kind).nbytes for b in blocks for kind in kinds)
        return held / sum(p.numel for b in blocks for p in b.params)

    return per_param([b for b in engine.blocks if b.repeated]), per_param(list(engine.blocks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*LeafSpec.*")  # Lightning's own use of a torch API it deprecated
    params = sum(p.numel() for p in make_model(args.hidden, args.layers, seed=0).parameters())
    print(f"byte-level Llama, hidden {args.hidden}, {args.layers} layers: {params / 1e6:.1f}M parameters")
    print("| compression | decoder layers | whole model | format (large tensor) |")
    print("| --- | ---: | ---: | ---: |")
    for compression, bits in COMPRESSIONS.items():
        layers, whole = held_bytes(compression, args.hidden, args.layers)
        promised = codecs.state_bytes(1 << 20, bits) / (1 << 20) if bits else 8.0
        print(f"| {compression} | {layers:.3f} | {whole:.3f} | {promised:.3f} |", flush=True)


if __name__ == "__main__":
    main()
