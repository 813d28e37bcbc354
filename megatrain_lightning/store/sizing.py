"""How much memory and disk a store needs: one rule for the strategy (which sizes a run) and the planner
(which predicts one).

The disk tier's RAM cache must hold every block kind in use at once: a block being fetched into each
device slot, the weights, gradient, m and v of the block each optimizer thread is updating, and three
more in flight (a gradient being offloaded, a write-back, the next fetch). Its files hold the master
weights, Adam m and v, the gradient sums, and the per-pass sums of tied blocks.
"""

from __future__ import annotations

from lightning.fabric.utilities.exceptions import MisconfigurationException

from megatrain_lightning.store.layout import Block
from megatrain_lightning.store.memory import pages

FP32_BYTES = 4
# The gradient offload's staging buffers on CUDA (page-locked), each the largest block in fp32.
STAGING_BUFFERS = 2
KINDS_PER_UPDATE = 4  # weights, gradient, m and v of the block an optimizer thread updates
IN_FLIGHT = 3  # a gradient being offloaded, a write-back, the next fetch
_GB = 1e9


def working_blocks(num_slots: int, optimizer_threads: int = 1) -> int:
    """Blocks of one fp32 kind the disk tier's cache must hold at once."""
    return num_slots + KINDS_PER_UPDATE * optimizer_threads + IN_FLIGHT


def staging_bytes(largest_numel: int) -> int:
    """Page-locked host memory of the gradient offload's staging buffers (on CUDA)."""
    return STAGING_BUFFERS * pages(FP32_BYTES * largest_numel)


def region_bytes(blocks: list[Block]) -> int:
    """Disk bytes of one fp32 kind (e.g. the master weights) for ``blocks``."""
    return sum(pages(FP32_BYTES * b.numel) for b in blocks)


def disk_files_bytes(blocks: list[Block]) -> int:
    """The disk tier's files: weights, m, v, gradient sums, and per-pass sums of tied blocks."""
    return 4 * region_bytes(blocks) + region_bytes([b for b in blocks if len(b.sites) > 1])


def num_slots_for(max_vram_gb: float, slot_bytes: int) -> int:
    """How many slots of ``slot_bytes`` (the largest block on the device) ``max_vram_gb`` holds; at least
    one."""
    num_slots = int(max_vram_gb * _GB // slot_bytes)
    if num_slots < 1:
        raise MisconfigurationException(
            f"`max_vram_gb={max_vram_gb}` is smaller than the largest block "
            f"({slot_bytes / _GB:.3g} GB on the device); raise it to at least that."
        )
    return num_slots


def cache_bytes_for(
    blocks: list[Block],
    num_slots: int,
    optimizer_threads: int,
    max_cpu_gb: float | None,
    default_bytes: int,
) -> int:
    """The disk tier's cache: ``max_cpu_gb`` if given (refused below the working set), else
    ``default_bytes`` raised to the working set."""
    working_set = working_blocks(num_slots, optimizer_threads) * FP32_BYTES * max(b.numel for b in blocks)
    if max_cpu_gb is None:
        return max(working_set, default_bytes)
    if max_cpu_gb * _GB < working_set:
        raise MisconfigurationException(
            f"`max_cpu_gb={max_cpu_gb}` cannot hold the blocks in use at once ({num_slots} slots, "
            f"{optimizer_threads} optimizer threads: {working_set / _GB:.3g} GB). Raise it to at "
            "least that, or lower `max_vram_gb`/`optimizer_threads`."
        )
    return int(max_cpu_gb * _GB)
