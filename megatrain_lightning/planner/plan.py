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
the blocks in use. The plan counts every parameter's gradient sum: all exist at a step's end under
accumulation or clipping (without either, the host tier holds only those of the blocks between their
backward and their update). Beside either, the gradient offload pins two staging buffers of the largest
block in fp32. Slots come in pools, one per block size on the device (the compute dtype except what stays
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
(:func:`megatrain_lightning.planner.traffic.least_disk_traffic`), and the host's AdamW.

Data parallel (``Machine.ranks_per_node`` ranks on each of ``Machine.nodes`` nodes): every figure is one
rank's. Each rank runs ``Workload``'s tokens, holds 1/ranks of the store, gradient sums and Adam state
(plain AdamW under DDP: everything), and shares its node's RAM, disk, disk bandwidth and host AdamW with
the node's other ranks. A fifth bound is the network: per micro-batch megatrain all-gathers each block
twice (forward and backward), in the dtypes the block computes in (bf16 weights under bf16), and
reduce-scatters its fp32 gradients once (``engine/distributed.py``), of which a rank receives
(ranks - 1)/ranks; DDP all-reduces the fp32
gradients once per step, ZeRO-Offload reduce-scatters gradients and all-gathers weights in the compute
dtype.

CPU only (``Machine.cpu``, no GPU): the compute device is the CPU and every figure is RAM. The activations
sit beside the store, and so do the slots: the host tier has none (blocks compute on the store's own weights,
``engine/host_views.py``), the disk tier's hold the two largest blocks (the rest of the RAM does more as its
cache). There is no link to bound a step, no staging buffer (gradients are added straight into the store),
and no ZeRO-Offload row (it offloads from a GPU); plain AdamW's update then runs at the host AdamW's rate.

:func:`plan_for` is what the strategy calls to resolve ``"auto"`` options;
:func:`megatrain_lightning.planner.table.format_plan` prints the table of ``megatrain plan``.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from megatrain_lightning.engine.slots import OVERLAP, Pools, slot_pools
from megatrain_lightning.optim.adamw import COMPRESSIONS as OPTIMIZER_COMPRESSIONS
from megatrain_lightning.planner.shape import MASTER_BYTES, ModelShape, load_shape
from megatrain_lightning.planner.traffic import least_disk_traffic
from megatrain_lightning.precision import SUPPORTED, MegaTrainPrecision
from megatrain_lightning.store.sizing import STATE_BYTES, min_cache_bytes, staging_bytes

GB = 1e9
# The compute dtypes of the precisions the strategy accepts, no more ("bf16" plans bf16-mixed's slots, whose
# fp32 embeddings and norms make them at least bf16-true's).
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
DTYPE_BYTES = {_NAMES[d]: d.itemsize for d in (MegaTrainPrecision(p).compute_dtype for p in SUPPORTED)}
GRAD_BYTES = 4.0  # fp32 host gradient accumulation buffer
PLAIN_BYTES = 16.0  # fp32 weights, gradients and Adam m, v on the GPU
COMPRESSIONS = tuple(OPTIMIZER_COMPRESSIONS)
NEAR_FASTEST = 0.1  # a lossier optimizer state is recommended only for a step bound shorter by more than this
RESERVE = 0.1  # share of GPU and host memory left to allocators, workspaces, the OS and data loading


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
    ranks_per_node: int = 1  # data parallel: a GPU each (the figures above are one GPU's, one node's)
    nodes: int = 1
    network_gbps: float = 25.0  # what each rank's collectives move per second (the slowest hop)
    # No GPU: the CPU computes, so activations and slots take the RAM (``vram_gb`` is unused) and no link
    # stands between them and the store; ``tflops`` is then the CPU's.
    cpu: bool = False

    @property
    def ranks(self) -> int:
        return self.ranks_per_node * self.nodes

    def received(self, nbytes: float) -> float:
        """Bytes a rank receives in a ring all-gather or reduce-scatter of a buffer of ``nbytes``."""
        return nbytes * (self.ranks - 1) / self.ranks

    @classmethod
    def detect(
        cls, device: torch.device | str = "cuda", offload_dir: str | os.PathLike | None = None
    ) -> Machine:
        """Free memory now: the GPU's (none where the CPU computes: a CPU-only machine), available RAM, free
        space under ``offload_dir`` (0 without one). Bandwidths and FLOP/s keep their defaults."""
        import psutil

        device = torch.device(device)
        ram = psutil.virtual_memory().available
        cpu = device.type != "cuda"
        vram = 0 if cpu else torch.cuda.mem_get_info(device)[0]
        disk = 0
        if offload_dir is not None:
            existing = Path(offload_dir)
            while not existing.exists():
                existing = existing.parent
            disk = shutil.disk_usage(existing).free
        return cls(vram_gb=vram / GB, ram_gb=ram / GB, disk_gb=disk / GB, cpu=cpu)


@dataclass(frozen=True)
class Workload:
    """Tokens per optimizer step and per micro-batch (``None``: one micro-batch per step)."""

    tokens_per_step: int = 4096
    micro_batch_tokens: int | None = None
    compute_dtype: str = "bf16"
    activation_checkpointing: bool = True
    zero_copy: bool = True  # CPU only: the host tier's blocks compute on the store's weights, without slots

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
    bound_by: str  # "compute", "link", "disk", "update" or "network"
    settings: Settings | None = None  # megatrain rows only
    network_gb: float = 0.0  # what a rank's collectives receive per step (data parallel)


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
    vram, ram, disk = (  # a rank's: its GPU, its share of its node's RAM and disk
        machine.vram_gb * GB * (1 - RESERVE),
        machine.ram_gb * GB * (1 - RESERVE) / machine.ranks_per_node,
        machine.disk_gb * GB / machine.ranks_per_node,
    )
    compute_s = 6 * n * workload.tokens_per_step / (machine.tflops * 1e12)
    micro, ranks = workload.micro_batches, machine.ranks
    # The host AdamW's share of a rank (megatrain's, ZeRO-Offload's): its part of the parameters, its part of
    # the node's cores.
    update_s = n / ranks / (machine.update_gparams / machine.ranks_per_node * GB)

    plain = PLAIN_BYTES * n + act  # on the GPU, or on a CPU-only machine in the RAM
    gpu, host, fits = (0.0, plain, plain <= ram) if machine.cpu else (plain, 0.0, plain <= vram)
    ddp = machine.received(2 * 4 * n)  # the fp32 gradients' all-reduce: a reduce-scatter and an all-gather
    plain_update_s = update_s * ranks if machine.cpu else 0.0  # CPU only: every rank updates the whole model
    times = (compute_s, 0.0, 0.0, plain_update_s, ddp, machine)
    rows = [_row("plain AdamW", gpu, host, 0.0, fits, *times)]
    if not machine.cpu:  # ZeRO-Offload offloads from a GPU
        gpu, host = cd * n + act, PLAIN_BYTES * n / ranks
        # Weights (compute dtype) up once per step, gradients (compute dtype) down after every micro-batch: a
        # rank's partition of each; the network gathers the weights and reduce-scatters every micro-batch's
        # grads.
        link_s = (1 + micro) * cd * n / ranks / (machine.pcie_gbps * GB)
        network = (1 + micro) * machine.received(cd * n)
        fits = gpu <= vram and host <= ram
        times = (compute_s, link_s, 0.0, update_s, network, machine)
        rows.append(_row("ZeRO-Offload", gpu, host, 0.0, fits, *times))
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
    n, ranks = shape.num_params, machine.ranks
    cd = DTYPE_BYTES[workload.compute_dtype]
    store = ((MASTER_BYTES + STATE_BYTES[compression]) * n + GRAD_BYTES * n) / ranks  # the rank's shard
    # The host tier's weights in the compute dtype (a sharded store keeps none: ranks convert as they send).
    shadowed = shape.shadow_numel(cd) if ranks == 1 else 0
    shadow = shadowed * cd
    # Page-locked beside the store or its cache; on the CPU gradients are added straight from the device.
    staging = 0 if machine.cpu else staging_bytes(shape.largest_block)
    overlap = sum(sorted(block_bytes, reverse=True)[:OVERLAP])  # one block computes while the next loads
    budget = max(vram - act, 0.0)
    if machine.cpu:
        # The activations take the RAM the store takes, and so do slots: the host tier has none (blocks
        # compute on the store's own weights: engine/host_views.py); the disk tier's hold the two largest
        # blocks (the rest of the RAM does more as its cache); data parallel gathers two blocks there.
        zero_copy = workload.zero_copy and ranks == 1 and store + shadow + act <= ram
        budget = 0.0 if zero_copy else overlap
        ram, vram = ram - act - budget, math.inf
    pools = slot_pools(block_bytes, budget)
    num_slots, slots = sum(count for _, count in pools), sum(size * count for size, count in pools)
    gpu_need = overlap + act
    if store + shadow + staging <= ram:
        tier, cache, host_need, disk_need = "host", store + shadow, store + shadow + staging, 0.0
    else:
        tier, disk_need = "disk", store
        cache = max(min(ram - staging, store), 0.0)
        host_need = min_cache_bytes(shape.largest_block, cuda=not machine.cpu) + staging  # chunks in use
    fits = gpu_need <= vram and host_need <= ram and disk_need <= disk
    # What the chosen settings use; where they do not fit, the least megatrain needs. Data parallel has no
    # slots: a rank holds the block computing and the one gathered ahead.
    gpu = slots + act if fits and ranks == 1 else gpu_need
    host = cache + staging if fits else host_need
    if machine.cpu:  # one memory: what a GPU would hold is in the RAM too
        gpu, host = 0.0, host + act + budget
    micro = workload.micro_batches
    # With every block resident, weights come in once per step (after the update); else twice per micro-batch:
    # from the host tier's shadow in the compute dtype, from the disk tier in fp32 (its slots convert). Data
    # parallel: a rank's shard of each, twice per micro-batch (gathered, never kept), and its gradients'.
    narrow = shadowed if tier == "host" else 0
    fetch_bytes = narrow * cd + (n - narrow) * MASTER_BYTES
    fetches = 1 if num_slots >= shape.num_blocks and ranks == 1 else 2 * micro
    linked = fetches * fetch_bytes + micro * GRAD_BYTES * n  # none where the CPU computes in its own RAM
    link_s = 0.0 if machine.cpu else linked / ranks / (machine.pcie_gbps * GB)
    # The shard's traffic: the least traffic scales with the store and cache (traffic.py).
    moved = sum(disk_traffic(shape, compression, micro, cache * ranks)) / ranks if tier == "disk" else 0.0
    disk_s = moved / (machine.disk_gbps / machine.ranks_per_node * GB)
    computed = shape.shadow_numel(cd) * cd + (n - shape.shadow_numel(cd)) * MASTER_BYTES  # a gather's bytes
    network = micro * (2 * machine.received(computed) + machine.received(GRAD_BYTES * n))
    settings = Settings(tier, pools, max(num_slots - 1, 1) if pools else 0, cache / GB, budget / GB)
    row = (gpu, host, disk_need, fits, compute_s, link_s, disk_s, update_s, network, machine, settings)
    return _row(f"megatrain {compression}", *row)


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
    network: float,
    machine: Machine,
    settings: Settings | None = None,
) -> Row:
    """A row from its memory (bytes) and the step's bounds (s), ``network`` the bytes a rank receives."""
    network_s = network / (machine.network_gbps * GB)
    times = {"compute": compute_s, "link": link_s, "disk": disk_s, "update": update_s, "network": network_s}
    bound_by = max(times, key=times.__getitem__)
    step_s = times[bound_by]
    return Row(method, gpu / GB, host / GB, disk / GB, fits, step_s, bound_by, settings, network / GB)


def allowed(lossiest: str | None) -> tuple[str, ...]:
    """The compressions no lossier than ``lossiest`` (``None``: all), least lossy first."""
    return COMPRESSIONS if lossiest is None else COMPRESSIONS[: COMPRESSIONS.index(lossiest) + 1]


def recommend(plan: Plan, lossiest: str | None = None) -> Row | None:
    """The megatrain row to use, of the compressions no lossier than ``lossiest`` (a user's bound on the
    optimizer state's loss; ``None``: any): the least compression whose store fits in RAM, else the least
    compression whose step bound is within ``NEAR_FASTEST`` of the shortest (disk traffic shrinks with the
    state, but a lossier state is worth only a real gain); ``None`` when none fits."""
    fitting = [r for r in (plan.row(f"megatrain {c}") for c in allowed(lossiest)) if r.fits]
    on_host = [r for r in fitting if r.settings is not None and r.settings.tier == "host"]
    if on_host:
        return on_host[0]
    fastest = min((r.step_s for r in fitting), default=None)
    return next((r for r in fitting if r.step_s <= fastest * (1 + NEAR_FASTEST)), None)


def shortfalls(row: Row, machine: Machine) -> list[tuple[str, float, float]]:
    """What ``row`` needs beyond ``machine`` (one rank's share of it), as ``(what, need GB, have GB)``
    with ``what`` one of ``"GPU"``, ``"RAM"``, ``"disk"``: the same bounds as the row's ``fits``."""
    have = (
        ("GPU", row.gpu_gb, machine.vram_gb * (1 - RESERVE)),
        ("RAM", row.host_gb, machine.ram_gb * (1 - RESERVE) / machine.ranks_per_node),
        ("disk", row.disk_gb, machine.disk_gb / machine.ranks_per_node),
    )
    return [(what, need, limit) for what, need, limit in have if need > limit]
