"""Hydra training app: ``megatrain-train`` (console script) or ``python examples/train.py``.

Composes ``configs/train.yaml`` from the groups ``model/``, ``data/``, ``strategy/``, ``trainer/``,
``callbacks/`` and ``logger/``, then fits. Examples::

    megatrain-train                                   # tiny Llama, shipped corpus, megatrain strategy
    megatrain-train strategy=plain model=tiny_gpt2    # Lightning's default strategy
    megatrain-train strategy=megatrain_nvme strategy.max_vram_gb=2 trainer.max_steps=200
    megatrain-train --multirun model.lr=1e-3,3e-3     # one run per value
    megatrain-train ckpt_path=outputs/.../last.ckpt   # resume a run from its checkpoint
"""

from __future__ import annotations

import logging
import typing
from typing import Any

import hydra
import lightning as L
from hydra.utils import instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf

from megatrain_lightning.serialization.checkpoint_dir import missing_resume_path
from megatrain_lightning.telemetry.monitor import with_progress_bar

log = logging.getLogger(__name__)


def build_strategy(cfg: DictConfig | str | None) -> object:
    """A strategy name stays a string (e.g. ``"auto"``); a config with ``_target_`` is instantiated.

    Instantiation imports the target lazily, so ``strategy=plain`` works without the megatrain
    strategy's modules.
    """
    if cfg is None:
        return "auto"
    if isinstance(cfg, str):
        return cfg
    return instantiate(cfg)


def instantiate_named(cfg: DictConfig | None) -> list[Any]:
    """Instantiate each entry of a ``name -> config`` group such as ``callbacks`` or ``logger``."""
    if not cfg:
        return []
    return [instantiate(entry) for entry in cfg.values() if entry is not None]


def check_trainer_options(options: dict[str, Any]) -> None:
    """Text given where Lightning's ``Trainer`` takes a number or a flag (``trainer.max_steps=abc``) is an
    error naming the option: Lightning would fail deep inside its loop with a ``TypeError``."""
    hints = typing.get_type_hints(L.Trainer.__init__)
    for name, value in options.items():
        accepted = set(typing.get_args(hints.get(name))) or {hints.get(name)}
        if isinstance(value, str) and accepted <= {int, float, bool, type(None)}:
            kinds = " or ".join(kind.__name__ for kind in (int, float, bool) if kind in accepted)
            raise MisconfigurationException(f"trainer.{name} takes {kinds}; got {value!r}.")


def log_through_root() -> None:
    """Lightning prints through a handler of its own when the root logger had none at import time,
    which keeps its messages out of Hydra's ``train.log``; hand them to the root logger's handlers."""
    if not logging.getLogger().handlers:
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:
                logger.removeHandler(handler)
        logger.propagate = True


def run(cfg: DictConfig) -> float | None:
    """Fit the configured module on the configured data; return the last logged ``train_loss``.

    Callbacks and loggers are the entries of the ``callbacks`` and ``logger`` groups; with no
    logger entry the run logs nothing (rather than Lightning's default logger in the cwd).
    ``ckpt_path`` resumes from a checkpoint (a path, or ``last``).
    """
    log_through_root()
    if problem := missing_resume_path(cfg.get("ckpt_path")):
        raise FileNotFoundError(problem)
    trainer_kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    check_trainer_options(trainer_kwargs)
    L.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    module = instantiate(cfg.model)
    strategy = build_strategy(cfg.get("strategy"))
    callbacks = instantiate_named(cfg.get("callbacks"))
    trainer = L.Trainer(
        strategy=strategy,
        callbacks=with_progress_bar(callbacks, trainer_kwargs.get("enable_progress_bar", True)),
        logger=instantiate_named(cfg.get("logger")) or False,
        **trainer_kwargs,
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    loss = trainer.callback_metrics.get("train_loss")
    if loss is None:
        log.info("final train_loss: not logged")
        return None
    log.info(f"final train_loss: {float(loss):.4f}")
    return float(loss)


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    return run(cfg)


if __name__ == "__main__":
    main()
