"""Footprint planner: will a model train on a machine, how should megatrain be set up, how fast can a step be.

Memory needs are computed, per way of training, from the bytes per parameter in DESIGN.md:

=====================  =====================================  ===========================  ===========
method                 GPU                                    host                         disk
=====================  =====================================  ===========================  ===========
plain AdamW            16 B/param + activations               0                            0
ZeRO-Offload           compute dtype B/param + activations    16 B/param                   0
megatrain, host tier   the 2 largest blocks + activations     store + shadow + 4 B/param    0
                                                              gradients
megatrain, disk tier   the 2 largest blocks + activations     the blocks in use (fp32)     host's need
=====================  =====================================  ===========================  ===========

where the megatrain store is 4 B/param of fp32 master weights plus the Adam state: 8 (fp32),
about 2.05 (int8), 1.09 (int4), 0.88 (int3) or 0.69 (int2) B/param (``codecs.state_bytes``: codes
plus one fp32 scale per block), and on the host tier under bf16 compute the shadow: 2 B/param of bf16
weights for the parameters that sit in the slots in bf16 (``store/host.py``). The host tier is chosen
when the store, the shadow and the gradient buffer fit in RAM; otherwise the store and the gradients
live on disk (as the strategy lays them out, without a shadow) and the RAM caches them, at least
the blocks in use. Beside either, the gradient offload pins two staging buffers of the largest block
in fp32. Slots come in pools, one per block size on the device (the compute dtype except what stays
fp32 under mixed precision: embeddings, norms, biases), sized from the GPU memory left beside the
activations by the engine's own rule (:func:`.slots.slot_pools`): at least the two largest blocks,
every block when they all fit.
Activations assume per-block checkpointing (block-boundary hidden states, one block's full
activations for the recompute, and the logits) unless the workload turns it off; attention is
assumed memory-efficient (no seq x seq scores).

The step-time lower bound is the largest of compute (6 x params x tokens / FLOP/s), link
transfer (weights in for forward and backward, fp32 gradients out, per micro-batch; the weights cross
in their slot dtype from the host tier's shadow, in fp32 from the disk tier, whose slots convert)
and, on the disk tier, the least traffic the step's schedule allows through the host cache
(:func:`megatrain_lightning.planner.traffic.least_disk_traffic`).
:func:`plan_for` is what the strategy calls to resolve ``"auto"`` options;
:func:`megatrain_lightning.planner.table.format_plan` prints the table of ``megatrain plan``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from megatrain_lightning.engine.blocks import discover_blocks
from megatrain_lightning.engine.slots import OVERLAP, Pools, mixed_fp32_numels, slot_pools
from megatrain_lightning.optim.adamw import COMPRESSIONS as OPTIMIZER_COMPRESSIONS
from megatrain_lightning.planner.traffic import least_disk_traffic
from megatrain_lightning.presets import llama_config, resolve_config, tiny_config
from megatrain_lightning.store.sizing import STATE_BYTES, min_cache_bytes, staging_bytes

GB = 1e9
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MASTER_BYTES = 4.0  # fp32 master weights in the store
GRAD_BYTES = 4.0  # fp32 host gradient accumulation buffer
PLAIN_BYTES = 16.0  # fp32 weights, gradients and Adam m, v on the GPU
COMPRESSIONS = tuple(OPTIMIZER_COMPRESSIONS)
RESERVE = 0.1  # share of GPU and host memory left to allocators, workspaces, the OS and data loading
PRESETS = ("tiny", "170m", "1b", "3b", "7b", "70b")


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: its paging blocks and the sizes that drive activations."""

    block_numels: tuple[int, ...]
    hidden_size: int
    mlp_width: int  # per token: the MLP's intermediate width (times the active experts for MoE)
    num_layers: int
    vocab_size: int
    # Per block, the elements that stay fp32 on the device under mixed precision (embeddings, norms,
    # biases: engine/slots.py); empty: none.
    fp32_numels: tuple[int, ...] = ()

    @property
    def num_params(self) -> int:
        return sum(self.block_numels)

    @property
    def largest_block(self) -> int:
        return max(self.block_numels)

    @property
    def num_blocks(self) -> int:
        return len(self.block_numels)

    def shadow_numel(self, dtype_bytes: int) -> int:
        """Parameters narrower than fp32 on the device in a compute dtype of ``dtype_bytes`` (none in fp32):
        what the host tier's shadow holds and the link carries at ``dtype_bytes`` each."""
        if dtype_bytes >= MASTER_BYTES:
            return 0
        kept = self.fp32_numels or (0,) * self.num_blocks
        return sum(n - k for n, k in zip(self.block_numels, kept, strict=True))

    def block_bytes(self, dtype_bytes: int) -> tuple[int, ...]:
        """Each block's bytes on the device in a compute dtype of ``dtype_bytes``, its fp32-kept parameters
        in fp32 when that dtype is narrower (the engine's layout may add a few hundred bytes of alignment
        between runs of different dtypes: engine/slots.py)."""
        kept = self.fp32_numels or (0,) * self.num_blocks
        wide = max(dtype_bytes, int(MASTER_BYTES))
        return tuple((n - k) * dtype_bytes + k * wide for n, k in zip(self.block_numels, kept, strict=True))

    @classmethod
    def from_module(cls, model: nn.Module, block_classes: Iterable[str | type] | None = None) -> ModelShape:
        """Blocks as the engine pages them (padding included); sizes from the Hugging Face config inside."""
        config = next(
            (m.config for m in model.modules() if isinstance(getattr(m, "config", None), PretrainedConfig)),
            None,
        )
        if config is None:
            raise ValueError(f"{type(model).__name__} holds no Hugging Face config to plan activations from")
        blocks = discover_blocks(model, block_classes)
        return cls.from_blocks([b.numel for b in blocks], config, mixed_fp32_numels(blocks))

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> ModelShape:
        """Build the model on the meta device (no memory, well under a second for 70B) and measure it."""
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return cls.from_module(model)

    @classmethod
    def from_blocks(
        cls, block_numels: Sequence[int], config: PretrainedConfig, fp32_numels: Sequence[int] = ()
    ) -> ModelShape:
        """From the engine's blocks (``[b.numel for b in blocks]``, and ``mixed_fp32_numels(blocks)``) and
        the model's (text) config; widths given per layer (Gemma-3n, Gemma-4) count at their largest."""
        config = config.get_text_config()
        hidden = config.hidden_size
        experts = _largest(getattr(config, "num_experts_per_tok", None)) or 1
        if getattr(config, "moe_intermediate_size", None):
            width = _largest(config.moe_intermediate_size) * experts
            width += _largest(getattr(config, "shared_expert_intermediate_size", None)) or 0
        else:
            width = (
                _largest(getattr(config, "intermediate_size", None))
                or _largest(getattr(config, "n_inner", None))
                or 4 * hidden
            ) * experts
        return cls(
            tuple(block_numels),
            hidden,
            width,
            config.num_hidden_layers,
            config.vocab_size,
            tuple(fp32_numels),
        )


def _largest(value: int | Sequence[int] | None) -> int | None:
    """A config width that may be given per layer."""
    if isinstance(value, (list, tuple)):
        return max(value, default=None)
    return value


@dataclass(frozen=True)
class Machine:
    """Memory in GB (1e9 bytes), bandwidths in GB/s, compute in TFLOP/s (dense, compute dtype), the host's
    AdamW in billions of parameters updated per second (megatrain's and ZeRO-Offload's updates run there;
    on one core of a 2-core VM the int4 kernel did 0.4 and torch's fp32 AdamW 0.12, the default is a
    server's)."""

    vram_gb: float
    ram_gb: float
    disk_gb: float = 0.0
    pcie_gbps: float = 25.0
    disk_gbps: float = 6.0
    tflops: float = 400.0
    update_gparams: float = 5.0

    @classmethod
    def detect(
        cls, device: torch.device | str = "cuda", offload_dir: str | os.PathLike | None = None
    ) -> Machine:
        """Free memory now: the device's (on CPU, available RAM again), available RAM, free space under
        ``offload_dir`` (0 without one). Bandwidths and FLOP/s keep their defaults."""
        import psutil

        device = torch.device(device)
        ram = psutil.virtual_memory().available
        vram = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else ram
        disk = 0
        if offload_dir is not None:
            existing = Path(offload_dir)
            while not existing.exists():
                existing = existing.parent
            disk = shutil.disk_usage(existing).free
        return cls(vram_gb=vram / GB, ram_gb=ram / GB, disk_gb=disk / GB)


@dataclass(frozen=True)
class Workload:
    """Tokens per optimizer step and per micro-batch (``None``: one micro-batch per step)."""

    tokens_per_step: int = 4096
    micro_batch_tokens: int | None = None
    compute_dtype: str = "bf16"
    activation_checkpointing: bool = True

    @property
    def micro_tokens(self) -> int:
        return self.micro_batch_tokens or self.tokens_per_step

    @property
    def micro_batches(self) -> int:
        return math.ceil(self.tokens_per_step / self.micro_tokens)


@dataclass(frozen=True)
class Settings:
    """What megatrain would choose on the machine: the strategy's ``"auto"`` options."""

    tier: str  # "host": the store in RAM; "disk": the store under offload_dir, cached in RAM
    slot_pools: Pools  # (slot bytes, count) per size that the budget buys: engine/slots.py
    prefetch_depth: int
    cache_gb: float  # RAM holding the store and gradients (all of them on the host tier)
    max_vram_gb: float  # the slots' budget: the GPU memory left beside the activations

    @property
    def num_slots(self) -> int:
        return sum(count for _, count in self.slot_pools)

    @property
    def slot_gb(self) -> float:
        """The GPU memory the slots take."""
        return sum(size * count for size, count in self.slot_pools) / GB


@dataclass(frozen=True)
class Row:
    method: str
    gpu_gb: float
    host_gb: float
    disk_gb: float
    fits: bool
    step_s: float
    bound_by: str  # "compute", "link" or "disk"
    settings: Settings | None = None  # megatrain rows only


@dataclass(frozen=True)
class Plan:
    model: ModelShape
    machine: Machine
    workload: Workload
    activations_gb: float
    slot_gb: float  # the largest slot: the largest block on the device
    rows: tuple[Row, ...]
    compression: str

    def row(self, method: str) -> Row:
        return next(r for r in self.rows if r.method == method)

    @property
    def settings(self) -> Settings:
        """The settings for ``compression``; check ``row(f"megatrain {compression}").fits`` first."""
        settings = self.row(f"megatrain {self.compression}").settings
        assert settings is not None
        return settings


def activation_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, checkpointing: bool = True) -> float:
    """Peak activation memory of one micro-batch of ``tokens`` tokens.

    A decoder layer keeps about ``10 h + 4 w`` values per token (norm inputs and outputs, q/k/v,
    attention output, residuals; gate, up, activation and product of the MLP). With checkpointing
    only each block's input (``h`` per token) stays, plus one layer's full set while it recomputes.
    The logits add ``vocab`` per token in the compute dtype plus an fp32 copy and its gradient.
    """
    layer = (10 * shape.hidden_size + 4 * shape.mlp_width) * tokens * dtype_bytes
    logits = tokens * shape.vocab_size * (dtype_bytes + 8)
    if not checkpointing:
        return shape.num_layers * layer + logits
    boundaries = shape.num_layers * shape.hidden_size * tokens * dtype_bytes
    return boundaries + layer + logits


def plan_for(
    model: ModelShape | PretrainedConfig | nn.Module | str | os.PathLike,
    machine: Machine,
    compression: str = "none",
    workload: Workload | None = None,
) -> Plan:
    """Memory needs of each way of training ``model`` on ``machine``, and megatrain's settings.

    Args:
        model: A :class:`ModelShape`, a Hugging Face config, a model (its blocks as the engine
            finds them), or a preset / ``config.json`` / model directory (see :func:`load_shape`).
        machine: The machine's budgets and speeds.
        compression: The optimizer-state storage whose settings :attr:`Plan.settings` returns.
        workload: Tokens per step and micro-batch, compute dtype, checkpointing.
    """
    if compression not in STATE_BYTES:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    workload = workload or Workload()
    if workload.compute_dtype not in DTYPE_BYTES:
        raise ValueError(f"compute_dtype must be one of {tuple(DTYPE_BYTES)}, got {workload.compute_dtype!r}")
    shape = load_shape(model)
    cd = DTYPE_BYTES[workload.compute_dtype]
    n = shape.num_params
    act = activation_bytes(shape, workload.micro_tokens, cd, workload.activation_checkpointing)
    vram, ram, disk = (
        machine.vram_gb * GB * (1 - RESERVE),
        machine.ram_gb * GB * (1 - RESERVE),
        machine.disk_gb * GB,
    )
    compute_s = 6 * n * workload.tokens_per_step / (machine.tflops * 1e12)

    rows = []
    gpu = PLAIN_BYTES * n + act
    rows.append(Row("plain AdamW", gpu / GB, 0.0, 0.0, gpu <= vram, compute_s, "compute"))
    gpu, host = cd * n + act, PLAIN_BYTES * n
    # Weights (compute dtype) up once per step, gradients (compute dtype) down after every micro-batch.
    link_s = (1 + workload.micro_batches) * cd * n / (machine.pcie_gbps * GB)
    update_s = n / (machine.update_gparams * GB)  # the host's AdamW over every parameter
    rows.append(
        _row("ZeRO-Offload", gpu, host, 0.0, gpu <= vram and host <= ram, compute_s, link_s, 0.0, update_s)
    )
    block_bytes = shape.block_bytes(cd)
    for name in COMPRESSIONS:
        rows.append(
            _megatrain_row(
                name, shape, workload, machine, act, block_bytes, compute_s, update_s, vram, ram, disk
            )
        )
    return Plan(shape, machine, workload, act / GB, max(block_bytes) / GB, tuple(rows), compression)


def _megatrain_row(
    compression: str,
    shape: ModelShape,
    workload: Workload,
    machine: Machine,
    act: float,
    block_bytes: tuple[int, ...],
    compute_s: float,
    update_s: float,
    vram: float,
    ram: float,
    disk: float,
) -> Row:
    n = shape.num_params
    cd = DTYPE_BYTES[workload.compute_dtype]
    store = (MASTER_BYTES + STATE_BYTES[compression]) * n + GRAD_BYTES * n
    shadow = shape.shadow_numel(cd) * cd  # the host tier's weights in the compute dtype
    staging = staging_bytes(shape.largest_block)  # page-locked beside the store or its cache
    budget = max(vram - act, 0.0)
    pools = slot_pools(block_bytes, budget)
    num_slots, slots = sum(n for _, n in pools), sum(size * n for size, n in pools)
    gpu_need = sum(sorted(block_bytes, reverse=True)[:OVERLAP]) + act
    if store + shadow + staging <= ram:
        tier, cache, host_need, disk_need = "host", store + shadow, store + shadow + staging, 0.0
    else:
        tier, disk_need = "disk", store
        cache = max(min(ram - staging, store), 0.0)
        host_need = min_cache_bytes(shape.largest_block) + staging  # the store chunks in use at once
    fits = gpu_need <= vram and host_need <= ram and disk_need <= disk
    # What the chosen settings use; where they do not fit, the least megatrain needs.
    gpu, host = (slots + act, cache + staging) if fits else (gpu_need, host_need)
    micro = workload.micro_batches
    # With every block resident, weights come in once per step (after the update); else twice per micro-batch:
    # from the host tier's shadow in the compute dtype, from the disk tier in fp32 (its slots convert).
    narrow = shape.shadow_numel(cd) if tier == "host" else 0
    fetch_bytes = narrow * cd + (n - narrow) * MASTER_BYTES
    fetches = 1 if num_slots >= shape.num_blocks else 2 * micro
    link_s = (fetches * fetch_bytes + micro * GRAD_BYTES * n) / (machine.pcie_gbps * GB)
    disk_s = (
        sum(disk_traffic(shape, compression, micro, cache)) / (machine.disk_gbps * GB)
        if tier == "disk"
        else 0.0
    )
    settings = Settings(tier, pools, max(num_slots - 1, 1), cache / GB, budget / GB)
    return _row(
        f"megatrain {compression}", gpu, host, disk_need, fits, compute_s, link_s, disk_s, update_s, settings
    )


def disk_traffic(
    shape: ModelShape, compression: str, micro_batches: int, cache: float
) -> tuple[float, float]:
    """Bytes the disk tier reads and writes per step, at least (:func:`least_disk_traffic` for the shape)."""
    weights = MASTER_BYTES * shape.num_params
    traffic = least_disk_traffic(
        weights,
        STATE_BYTES[compression] * shape.num_params,
        cache,
        micro_batches,
        GRAD_BYTES * shape.largest_block,
    )
    return traffic.reads, traffic.writes


def _row(
    method: str,
    gpu: float,
    host: float,
    disk: float,
    fits: bool,
    compute_s: float,
    link_s: float,
    disk_s: float,
    update_s: float,
    settings: Settings | None = None,
) -> Row:
    times = {"compute": compute_s, "link": link_s, "disk": disk_s, "update": update_s}
    bound_by = max(times, key=times.__getitem__)
    return Row(method, gpu / GB, host / GB, disk / GB, fits, times[bound_by], bound_by, settings)


def load_shape(model: ModelShape | PretrainedConfig | nn.Module | str | os.PathLike) -> ModelShape:
    """A :class:`ModelShape` from a shape, a config, a model, or a string naming a preset
    (``tiny``, ``170m``, ``1b``, ``7b``, ``70b``), a ``config.json`` file or a model directory."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, nn.Module):
        return ModelShape.from_module(model)
    if isinstance(model, PretrainedConfig):
        return ModelShape.from_config(model)
    return ModelShape.from_config(_load_config(os.fspath(model)))


def _load_config(spec: str) -> PretrainedConfig:
    if spec.lower() == "tiny":
        return tiny_config("llama")
    if spec.lower() in PRESETS:
        return llama_config(spec)
    path = Path(spec)
    if path.is_file():
        return resolve_config(json.loads(path.read_text()))[0]
    if path.is_dir():
        return AutoConfig.from_pretrained(path)
    raise ValueError(
        f"model {spec!r} is neither a preset ({', '.join(PRESETS)}), a config.json nor a directory"
    )


def recommend(plan: Plan) -> Row | None:
    """The megatrain row to use: the least compression whose store fits in RAM, else the fitting row
    with the shortest step bound (disk traffic shrinks with the state); ``None`` when none fits."""
    fitting = [r for r in (plan.row(f"megatrain {c}") for c in COMPRESSIONS) if r.fits]
    on_host = [r for r in fitting if r.settings is not None and r.settings.tier == "host"]
    if on_host:
        return on_host[0]
    return min(fitting, key=lambda r: r.step_s, default=None)
