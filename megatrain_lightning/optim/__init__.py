from megatrain_lightning.optim.adamw import CPUAdamW

__all__ = ["CPUAdamW"]
