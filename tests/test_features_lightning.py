"""Lightning features that reach into parameters and optimizers: as under the default strategy."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from conftest import UserLM, assert_same_training, tiny_model, token_batches, user_fit
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.tuner import Tuner

from megatrain_lightning import MegaTrainStrategy


class UnfreezeLastLayer(BaseFinetuning):
    """Lightning's fine-tuning callback: the last decoder layer frozen, unfrozen as a new param group."""

    def freeze_before_training(self, pl_module) -> None:
        self.freeze(pl_module.model.model.layers[-1])

    def finetune_function(self, pl_module, current_epoch, optimizer) -> None:
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.model.model.layers[-1], optimizer, lr=1e-3)


class FrozenAtStartLM(UserLM):
    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def test_base_finetuning_unfreezes_into_a_new_param_group():
    model = tiny_model("llama")
    kwargs = dict(module_cls=FrozenAtStartLM, steps=6, max_epochs=2, limit_train_batches=3)
    plain = user_fit(model, "auto", callbacks=[UnfreezeLastLayer()], **kwargs)
    paged = user_fit(model, MegaTrainStrategy(), callbacks=[UnfreezeLastLayer()], **kwargs)
    assert_same_training(plain, paged)


def test_lr_find_runs_and_restores_the_weights(tmp_path):
    model = tiny_model("llama")
    results = {}
    for name, strategy in [("plain", "auto"), ("megatrain", MegaTrainStrategy())]:
        module = UserLM(model)
        trainer = L.Trainer(
            strategy=strategy,
            accelerator="cpu",
            max_steps=4,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path / name,
        )
        loader = torch.utils.data.DataLoader(token_batches(12), batch_size=None)
        finder = Tuner(trainer).lr_find(module, train_dataloaders=loader, num_training=8, update_attr=False)
        results[name] = (finder.results["loss"], {k: v.clone() for k, v in module.state_dict().items()})
        assert not [f for f in os.listdir(tmp_path / name) if "lr_find" in f], "lr_find left its checkpoint"
    assert results["plain"][0] == pytest.approx(results["megatrain"][0], rel=1e-6)
    for key, value in results["plain"][1].items():
        assert torch.equal(results["megatrain"][1][key], value), key


class ForeignTensorLM(UserLM):
    def configure_optimizers(self):
        extra = torch.nn.Parameter(torch.zeros(3))
        return torch.optim.AdamW([*self.parameters(), extra], lr=self.lr)


def test_an_optimizer_over_tensors_outside_the_module_is_refused_before_training():
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match="not a parameter of the LightningModule"):
        user_fit(tiny_model("llama"), MegaTrainStrategy(), module_cls=ForeignTensorLM)
