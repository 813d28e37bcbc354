"""megatrain_lightning: train models larger than GPU memory with ``Trainer(strategy="megatrain")``."""

from megatrain_lightning.hf_args import UnsupportedArgumentWarning
from megatrain_lightning.hf_trainer import Trainer, init
from megatrain_lightning.optim.adamw import CPUAdamW
from megatrain_lightning.precision import MegaTrainPrecision
from megatrain_lightning.serialization.export import export_hf
from megatrain_lightning.serialization.hf import from_pretrained
from megatrain_lightning.serialization.single_file import convert_checkpoint, open_checkpoint
from megatrain_lightning.strategy import MegaTrainStrategy

__all__ = [
    "CPUAdamW",
    "MegaTrainPrecision",
    "MegaTrainStrategy",
    "Trainer",
    "UnsupportedArgumentWarning",
    "convert_checkpoint",
    "export_hf",
    "from_pretrained",
    "init",
    "open_checkpoint",
]


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    if MegaTrainStrategy.strategy_name not in StrategyRegistry:
        MegaTrainStrategy.register_strategies(StrategyRegistry)


_register()
