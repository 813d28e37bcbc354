"""From the strategy's options and the model's blocks to the engine's settings: slots, prefetch depth,
the disk tier's folder and cache. Options left to ``None``/``"auto"`` take the planner's choice for
this machine; the disk tier's folder, free space and cache are checked before anything is written."""

from __future__ import annotations

import difflib
import inspect
import math
import os
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.strategies import ParallelStrategy

from megatrain_lightning.engine.runtime import EngineConfig
from megatrain_lightning.engine.slots import OVERLAP, SlotLayout, mixed_fp32_numels, serial_blocks, slot_pools
from megatrain_lightning.optim.adamw import COMPRESSIONS
from megatrain_lightning.planner.plan import Machine, ModelShape, Settings, Workload, plan_for
from megatrain_lightning.serialization.hf import hf_model
from megatrain_lightning.store import sizing
from megatrain_lightning.store.io import IOConfig
from megatrain_lightning.store.layout import Block
from megatrain_lightning.store.memory import ALIGNMENT
from megatrain_lightning.store.preflight import (
    available_ram_bytes,
    check_disk_space,
    check_host_ram,
    missing_dirs,
    prepare_offload_dir,
    remove_empty_dirs,
)

if TYPE_CHECKING:
    from megatrain_lightning.strategy import MegaTrainStrategy

_GB = 1e9


def check_option_names(strategy: type, kwargs: dict[str, Any]) -> None:
    """Refuse a keyword neither ``strategy`` nor Lightning's ``ParallelStrategy`` takes (a typo such as
    ``max_vram``), naming the closest option: Python's own ``TypeError`` would blame ``ParallelStrategy``."""
    lightning = [name for name in inspect.signature(ParallelStrategy.__init__).parameters if name != "self"]
    unknown = [name for name in kwargs if name not in lightning]
    if not unknown:
        return
    own = [name for name in inspect.signature(strategy.__init__).parameters if name not in ("self", "kwargs")]
    close = difflib.get_close_matches(unknown[0], own + lightning, n=1)
    hint = f" Did you mean `{close[0]}`?" if close else ""
    raise MisconfigurationException(
        f"{strategy.__name__} has no option `{unknown[0]}`.{hint} Its options are listed in the README's "
        f'"Options" section and in `help({strategy.__name__})`.'
    )


def compression_option(value: str | bool) -> str:
    """``optimizer_compression``: a mode of ``COMPRESSIONS``; ``True`` (the seed article's) means int4."""
    if isinstance(value, bool):
        value = "int4" if value else "none"
    if value not in COMPRESSIONS:
        raise MisconfigurationException(
            f"`optimizer_compression` must be one of {tuple(COMPRESSIONS)}; got {value!r}."
        )
    return value


def int_option(name: str, value: Any, least: int, auto: bool = False) -> int | str:
    """An integer option of at least ``least`` (or ``"auto"`` where the planner may choose)."""
    if auto and value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        choices = "'auto' or an int" if auto else "an int"
        raise MisconfigurationException(f"`{name}` must be {choices} >= {least}; got {value!r}.")
    return value


def io_option(threads: Any, chunk_mb: Any) -> IOConfig:
    """``io_threads`` and ``io_chunk_mb`` (``None``: 16 MB, the host tier's choice where it may use whole
    blocks), the chunk in whole pages (O_DIRECT moves page-aligned lengths)."""
    int_option("io_threads", threads, least=1)
    if gb_option("io_chunk_mb", chunk_mb) is None:
        return IOConfig(threads=threads)
    chunk_bytes = max(ALIGNMENT, int(chunk_mb * (1 << 20)) // ALIGNMENT * ALIGNMENT)
    return IOConfig(chunk_bytes=chunk_bytes, threads=threads, host_chunks=True)


def gb_option(name: str, value: Any) -> float | None:
    """A budget option in GB: a positive finite number, or ``None`` for the planner's choice."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise MisconfigurationException(f"`{name}` must be a positive number of GB or None; got {value!r}.")
    return float(value)


def engine_config(strategy: MegaTrainStrategy, blocks: list[Block]) -> tuple[EngineConfig, list[str]]:
    """Size the slots (for the disk tier: check the folder, the disk and the cache) from the blocks.
    Options left to ``None``/``"auto"`` take the planner's settings for this machine. Also returns the
    folders created for ``offload_dir`` (removed with the store)."""
    dtype = strategy.precision_plugin.compute_dtype
    mixed = strategy.precision_plugin.precision == "bf16-mixed"
    layout = SlotLayout(blocks, dtype, mixed)
    auto = _plan(strategy, blocks, dtype, mixed)
    if strategy.max_vram_gb is not None:
        budget = strategy.max_vram_gb * _GB
    elif auto is not None:  # the planner's budget, for at least the largest block
        budget = max(auto.max_vram_gb * _GB, layout.nbytes)
    else:
        budget = None  # a slot per block
    pools = slot_pools(layout.block_bytes, budget)
    if not pools:
        raise MisconfigurationException(
            f"`max_vram_gb={strategy.max_vram_gb}` is smaller than the largest block "
            f"({layout.nbytes / _GB:.3g} GB on the device); raise it to at least that."
        )
    num_slots = sum(count for _, count in pools)
    offload_dir, cache_bytes, created = _disk_tier(strategy, blocks, auto)
    auto_prefetch = strategy.prefetch_depth == "auto"
    config = EngineConfig(
        device=strategy.root_device,
        compute_dtype=dtype,
        mixed_precision=mixed,
        slot_pools=pools,
        prefetch_depth=_auto_depth(strategy, num_slots) if auto_prefetch else strategy.prefetch_depth,
        activation_checkpointing=strategy.activation_checkpointing,
        pin_memory=strategy.root_device.type == "cuda",
        offload_dir=offload_dir,
        cache_bytes=cache_bytes,
        keep_offload_dir=strategy.keep_offload_dir,
        io=strategy.io,
        zero_copy=strategy.zero_copy,
    )
    # Slots go unused where blocks compute on the store's own weights (the CPU's host tier).
    if (
        not (strategy.data_parallel or config.binds_store)
        and (serial := serial_blocks(layout.block_bytes, pools)) > 1
    ):
        overlap = sum(sorted(layout.block_bytes, reverse=True)[:OVERLAP])
        rank_zero_warn(
            f"megatrain: in the slot budget of {budget / _GB:.3g} GB, {serial} of the {len(blocks)} blocks "
            "fit only one device slot, so each is fetched after the one before it has computed (nothing "
            f"loads ahead); `max_vram_gb={overlap / _GB:.3g}` (the two largest blocks) lets one load while "
            "another computes."
        )
    return config, created


def _auto_depth(strategy: MegaTrainStrategy, num_slots: int) -> int:
    """Blocks fetched ahead: as many as free slots hold; data parallel: one gather (each gathered block is
    a buffer of its own outside the slots, as FSDP's prefetch of one)."""
    return 1 if strategy.data_parallel else max(num_slots - 1, 1)


def _plan(
    strategy: MegaTrainStrategy, blocks: list[Block], dtype: torch.dtype, mixed: bool
) -> Settings | None:
    """The planner's settings for this model on this machine (``megatrain plan`` prints the same)."""
    found = hf_model(strategy.lightning_module)
    if found is None:
        return None
    fp32_numels = mixed_fp32_numels(blocks) if mixed else ()
    shape = ModelShape.from_blocks([b.numel for b in blocks], found[1].config, fp32_numels)
    workload = Workload(
        compute_dtype="fp32" if dtype == torch.float32 else "bf16",
        activation_checkpointing=strategy.activation_checkpointing,
        zero_copy=strategy.zero_copy and strategy.offload_dir is None,  # the engine's `binds_store`
    )
    offload_dir = None if strategy.offload_dir in (None, "auto") else strategy.offload_dir
    machine = Machine.detect(strategy.root_device, offload_dir)
    return plan_for(shape, machine, strategy.optimizer_compression, workload).settings


def _warn_disk_options_unused(strategy: MegaTrainStrategy) -> None:
    given = [
        name
        for name, set_ in (
            ("max_cpu_gb", strategy.max_cpu_gb is not None),
            ("io_threads", strategy.io.threads != IOConfig.threads),
        )
        if set_
    ]
    if given:
        rank_zero_warn(
            f"megatrain: {' and '.join(f'`{name}`' for name in given)} size the disk tier; without "
            "`offload_dir` the store is in RAM and they change nothing. Set `offload_dir` to page through a "
            "folder on disk."
        )


def _disk_tier(
    strategy: MegaTrainStrategy, blocks: list[Block], auto: Settings | None
) -> tuple[str | None, int, list[str]]:
    if strategy.offload_dir is None:
        _warn_disk_options_unused(strategy)
        return None, 0, []
    path = strategy.offload_dir
    if path == "auto":
        path = os.path.join(strategy.lightning_module.trainer.default_root_dir, "megatrain_offload")
    created = missing_dirs(path)
    try:
        path = prepare_offload_dir(path)
        accumulating = strategy.lightning_module.trainer.accumulate_grad_batches > 1
        files = sizing.disk_files_bytes(blocks, strategy.optimizer_compression, gradients=accumulating)
        check_disk_space(path, files)
        default = int(auto.cache_gb * _GB) if auto is not None else min(files, available_ram_bytes() // 2)
        threads = strategy.optimizer_threads or 1
        cuda = strategy.root_device.type == "cuda"
        cache = sizing.cache_bytes_for(
            blocks, threads, strategy.max_cpu_gb, default, strategy.io.chunk_numel, cuda
        )
        if cuda:  # the cache and the offload's staging are page-locked
            check_host_ram(cache / _GB, sizing.staging_bytes(max(b.numel for b in blocks)))
    except BaseException:
        remove_empty_dirs(created)  # a refused run leaves no empty folder behind
        raise
    return path, cache, created
