"""Compressed optimizer state inside the engine: bytes held, convergence, exact round trips, bitwise
resume and refusal of state stored in another format, for every mode."""

from __future__ import annotations

import copy
import math

import lightning as L
import pytest
import torch
from conftest import LossRecorder, fit, quiet_trainer, tiny_model
from lightning.pytorch.callbacks import ModelCheckpoint

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.data import TextDataModule
from megatrain_lightning.models import CausalLMModule
from megatrain_lightning.optim import codecs
from megatrain_lightning.optim import state_dict as adam_state

COMPRESSED = ["int8", "int4", "int3", "int2"]
# bytes of m, v (and scales) per parameter: codecs.state_bytes of each format (2.047, 1.094, 0.875, 0.6875)
BOUNDS = {"none": 8.0, "int8": 2.1, "int4": 1.1, "int3": 0.9, "int2": 0.7}


@pytest.mark.parametrize("compression", ["none", *COMPRESSED])
def test_state_bytes_per_parameter_in_the_store(compression):
    model = tiny_model(
        "llama", hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=4
    )
    run = fit(model, MegaTrainStrategy(optimizer_compression=compression), steps=2, seq_len=16)
    engine = run.trainer.strategy.engine
    kinds = engine.optimizer.state_kinds
    layers = [b for b in engine.blocks if b.repeated]
    held = sum(engine.store.read(b.index, kind).nbytes for b in layers for kind in kinds)  # actual buffers
    params = sum(p.numel for b in layers for p in b.params)
    per_param = held / params
    assert per_param <= BOUNDS[compression], per_param
    if compression == "none":
        assert per_param >= 8.0
    else:  # the layers' large matrices hold exactly the format's bytes; their norms keep fp32 moments
        fmt_bytes = codecs.state_bytes(1 << 20, engine.optimizer.bits) / (1 << 20)
        assert fmt_bytes <= per_param <= fmt_bytes + 0.02, (per_param, fmt_bytes)
    stats = run.trainer.strategy.stats
    assert stats.optimizer_state_bytes == engine.optimizer.state_bytes() > 0


def test_compression_true_means_int4():
    assert MegaTrainStrategy(optimizer_compression=True).optimizer_compression == "int4"
    assert MegaTrainStrategy(optimizer_compression=False).optimizer_compression == "none"


@pytest.mark.parametrize("compression", COMPRESSED)
def test_compressed_state_dict_round_trips_exactly(compression):
    run = fit(tiny_model("llama"), MegaTrainStrategy(optimizer_compression=compression), steps=3)
    optimizer = run.trainer.optimizers[0]
    saved = optimizer.state_dict()
    copies = {b: {k: t.clone() for k, t in state.items()} for b, state in saved["blocks"].items()}
    for block in saved["blocks"]:
        for kind in optimizer.state_kinds:
            optimizer.store.read(block, kind).zero_()
    optimizer.load_state_dict({**saved, "blocks": copies})
    again = optimizer.state_dict()["blocks"]
    for block, state in copies.items():
        for kind, tensor in state.items():
            assert torch.equal(again[block][kind], tensor), (block, kind)
    assert saved["codec"] == {"compression": compression, "version": codecs.FORMAT_VERSION}


def test_state_of_another_format_is_refused_clearly():
    run = fit(tiny_model("llama"), MegaTrainStrategy(optimizer_compression="int4"), steps=1)
    optimizer = run.trainer.optimizers[0]
    saved = optimizer.state_dict()
    old = {k: v for k, v in saved.items() if k != "codec"}  # as saved before the format was recorded
    with pytest.raises(ValueError, match="int4 format version 1"):
        optimizer.load_state_dict(old)
    with pytest.raises(ValueError, match="optimizer_compression='int3'"):
        optimizer.load_state_dict(
            {**saved, "codec": {"compression": "int3", "version": codecs.FORMAT_VERSION}}
        )
    optimizer.load_state_dict(saved)  # today's format loads


def _linear_v8(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8's v as format versions 1 and 2 stored it: code c -> (c + 1) / 256 of the block max."""
    blocks = torch.nn.functional.pad(v, (0, -v.numel() % 128)).view(-1, 128)
    scales = blocks.amax(1).clamp(min=codecs.V_FLOOR) / 256
    codes = (torch.round(blocks / scales[:, None]) - 1).clamp(0, 255).to(torch.uint8)
    return codes.reshape(-1)[: v.numel()], scales


def _with_linear_v8(saved: dict) -> tuple[dict, dict[int, torch.Tensor]]:
    """``saved``'s int8 blocks with their v as versions 1 and 2 stored it, and the values those codes mean."""
    blocks, meant = {}, {}
    for block, state in saved["blocks"].items():
        n = state["v_codes"].numel()
        codes, scales = _linear_v8(codecs.dequantize(state["v_codes"], state["v_scales"], "v", 8, n))
        blocks[block] = {**{k: t.clone() for k, t in state.items()}, "v_codes": codes, "v_scales": scales}
        meant[block] = (codes.to(torch.float32) + 1) * scales.repeat_interleave(128)[:n]
    return {**saved, "blocks": blocks}, meant


def _assert_converted(optimizer, old: dict, meant: dict[int, torch.Tensor]) -> None:
    """m as saved; v within the log map's rounding of what the old codes meant."""
    assert sum(v.numel() for v in meant.values()) > 0
    for block, state in optimizer.state_dict()["blocks"].items():
        assert torch.equal(state["m_codes"], old["blocks"][block]["m_codes"])
        v = codecs.dequantize(state["v_codes"], state["v_scales"], "v", 8, state["v_codes"].numel())
        assert ((v - meant[block]).abs() <= codecs.error_bound(meant[block], "v", 8)).all()


@pytest.mark.parametrize("version", [1, 2])
def test_int8_state_with_the_linear_v_map_is_converted(version):
    """int8 state saved by format versions 1 and 2 (v on a linear map) loads into today's log map."""
    run = fit(tiny_model("llama"), MegaTrainStrategy(optimizer_compression="int8"), steps=2)
    optimizer = run.trainer.optimizers[0]
    old, meant = _with_linear_v8(optimizer.state_dict())
    old["codec"] = {"compression": "int8", "version": version}
    if version == 1:  # saved before the codec was recorded
        del old["codec"]
    optimizer.load_state_dict(old)
    _assert_converted(optimizer, old, meant)


def test_an_int8_checkpoint_with_the_linear_v_map_resumes_converted(tmp_path, monkeypatch):
    """A checkpoint directory written by format version 2 resumes under today's: its v converted, then
    training goes on from it."""
    run = fit(tiny_model("llama"), MegaTrainStrategy(optimizer_compression="int8"), steps=2)
    optimizer = run.trainer.optimizers[0]
    old, meant = _with_linear_v8(optimizer.state_dict())
    optimizer.load_state_dict(old)  # the store now holds version 2's codes, as such a run left them
    with monkeypatch.context() as patch:
        patch.setattr(
            adam_state, "codec_info", lambda compression: {"compression": compression, "version": 2}
        )
        run.trainer.save_checkpoint(tmp_path / "v2.ckpt")
    resumed = fit(tiny_model("llama"), MegaTrainStrategy(optimizer_compression="int8"), steps=2,
                  ckpt_path=tmp_path / "v2.ckpt")  # fmt: skip
    _assert_converted(resumed.trainer.optimizers[0], old, meant)
    more = fit(tiny_model("llama"), MegaTrainStrategy(optimizer_compression="int8"), steps=4,
               ckpt_path=tmp_path / "v2.ckpt")  # fmt: skip
    assert len(more.losses) == 2 and all(math.isfinite(loss) for loss in more.losses)


def _resumable_fit(compression: str, root, steps: int, ckpt_path=None) -> tuple[list[float], dict]:
    """Fit a small Llama on the shipped corpus, a checkpoint every 2 steps; (losses, final weights)."""
    torch.manual_seed(0)
    model = tiny_model("llama", num_hidden_layers=3, hidden_size=128, intermediate_size=256)
    module = CausalLMModule(copy.deepcopy(model), lr=1e-2, warmup_steps=2, max_steps=steps)
    recorder = LossRecorder()
    checkpoints = ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1)
    trainer = quiet_trainer(
        MegaTrainStrategy(optimizer_compression=compression), steps, [recorder, checkpoints],
        enable_checkpointing=True, limit_train_batches=2,  # epochs of 2 steps: resumable at their ends
    )  # fmt: skip
    L.seed_everything(1, verbose=False)
    trainer.fit(module, datamodule=TextDataModule(seq_len=32, batch_size=2), ckpt_path=ckpt_path)
    return recorder.losses, {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("compression", COMPRESSED)
def test_resume_is_bitwise(compression, tmp_path):
    """Stopped after step 2 and resumed from its checkpoint: steps 3-4 and the final weights equal the
    uninterrupted run's bit for bit (the quantized state round-trips exactly through the checkpoint)."""
    losses, weights = _resumable_fit(compression, tmp_path / "full", 4)
    resumed_losses, resumed = _resumable_fit(
        compression, tmp_path / "resumed", 4, ckpt_path=tmp_path / "full" / "epoch=0-step=2.ckpt"
    )
    assert resumed_losses == losses[2:]
    for name, tensor in weights.items():
        assert torch.equal(resumed[name], tensor), name


def _final_loss(compression: str) -> tuple[float, list[float]]:
    run = fit(
        tiny_model("llama"),
        MegaTrainStrategy(optimizer_compression=compression),
        steps=300,
        lr=1e-3,
        seq_len=64,
        batch_size=8,
    )
    return sum(run.losses[-20:]) / 20, run.losses


def test_compressed_state_converges_like_fp32():
    """300 steps on the shipped corpus at lr 1e-3: the last 20 steps' mean loss of int8 within 1% of
    fp32's, int4 within 2% (the curves: benchmarks/convergence.png, from benchmarks/convergence.py)."""
    reference, _ = _final_loss("none")
    int8, _ = _final_loss("int8")
    int4, _ = _final_loss("int4")
    assert abs(int8 - reference) <= 0.01 * reference, (int8, reference)
    assert abs(int4 - reference) <= 0.02 * reference, (int4, reference)


@pytest.mark.parametrize(
    ("compression", "tier"), [("int4", "host"), ("int4", "disk"), ("int8", "disk"), ("none", "disk")]
)
def test_chunked_updates_equal_whole_block_updates(tmp_path, compression, tier):
    """Blocks cut into 1024-element chunks (parameters and quantization blocks split across chunks, the
    quantized/fp32 border inside one) train bitwise like blocks updated whole (stochastic rounding's
    numbers follow the element, not the chunk)."""
    model = tiny_model("llama", intermediate_size=136)  # odd sizes: runs end inside quantization blocks
    runs = []
    for chunk_mb in (16, 4096 / 2**20):
        offload = {"offload_dir": tmp_path / str(chunk_mb)} if tier == "disk" else {}
        strategy = MegaTrainStrategy(optimizer_compression=compression, io_chunk_mb=chunk_mb, **offload)
        runs.append(fit(model, strategy, steps=3))
    whole, chunked = runs
    assert max(b.numel for b in chunked.trainer.strategy.engine.blocks) > 8 * 1024
    assert chunked.losses == whole.losses
    for name, value in whole.state_dict().items():
        assert torch.equal(chunked.state_dict()[name], value), name
