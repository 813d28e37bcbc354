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


def _refuse_fabric(**_: object) -> None:
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    raise MisconfigurationException(
        "megatrain is a strategy of Lightning's `Trainer` (`Trainer(strategy='megatrain')`): it pages the "
        "blocks through the Trainer's training step, optimizer step and checkpoint hooks, which Fabric's "
        "loop of your own does not call. Train with `lightning.Trainer`, or give Fabric one of its own "
        "strategies."
    )


def _register() -> None:
    """``strategy="megatrain"`` (and ``"megatrain_nvme"``) for the Trainer; for Fabric, a clear refusal."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES
    from lightning.pytorch.strategies import StrategyRegistry

    if MegaTrainStrategy.strategy_name not in StrategyRegistry:
        MegaTrainStrategy.register_strategies(StrategyRegistry)
    for name in ("megatrain", "megatrain_nvme"):
        if name not in FABRIC_STRATEGIES:
            FABRIC_STRATEGIES.register(
                name, _refuse_fabric, description="Refused: megatrain needs the Trainer"
            )


_register()
