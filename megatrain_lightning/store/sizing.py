"""How much memory and disk a store needs: one rule for the strategy (which sizes a run) and the planner
(which predicts one).

The disk tier's RAM cache holds chunks (``io_chunk_mb`` of fp32 each, never more than a block), and the
hot paths pin a few at a time: each fetch into a device slot one (on CUDA up to three while its copies
are in flight; two fetches run at once: the prefetcher's and a demand), the gradient offload two (the
gradient and its per-pass sum), each optimizer thread one chunk of each kind of the block it updates
(weights, gradient, m, v: at most four fp32 chunks' worth, less when the moments are quantized). The cache
must hold those and one more chunk (reads and write-backs in flight are waited for; small regions are
placed apart from large ones). So the RAM the disk tier needs is bounded by the chunk size, whatever the
block size. Its files hold the master weights and Adam m and v; the gradient sums (and per-pass sums of
tied blocks) reach them only when the cache must evict them before their update used them, which is
planned for under gradient accumulation.
"""

from __future__ import annotations

from lightning.fabric.utilities.exceptions import MisconfigurationException

from megatrain_lightning.optim import codecs
from megatrain_lightning.store.layout import CHUNK_NUMEL, Block
from megatrain_lightning.store.memory import pages

FP32_BYTES = 4
# Adam m and v per parameter: fp32, or a block-quantized format's codes and scales (codecs.FORMATS).
# Only the large parameters of repeated blocks are quantized.
STATE_BYTES = {"none": 8.0} | {
    f.name: codecs.state_bytes(1 << 20, bits) / (1 << 20) for bits, f in codecs.FORMATS.items()
}
FETCHES = 2  # the prefetcher's and a demand load
CUDA_FETCH_CHUNKS = 3  # chunks one fetch pins on CUDA (copies in flight); one elsewhere
OFFLOAD_CHUNKS = 2  # the gradient and its per-pass sum
KINDS_PER_UPDATE = 4  # weights, gradient, m and v of the chunk an optimizer thread updates
# The gradient offload's staging buffers on CUDA (page-locked), each the largest block in fp32.
STAGING_BUFFERS = 2
_GB = 1e9


def pinned_chunks(optimizer_threads: int = 1, cuda: bool = True) -> int:
    """fp32 chunks the hot paths of the disk tier pin at once, at most."""
    fetch = FETCHES * (CUDA_FETCH_CHUNKS if cuda else 1)
    return fetch + OFFLOAD_CHUNKS + KINDS_PER_UPDATE * optimizer_threads


def min_cache_bytes(
    largest_block: int, optimizer_threads: int = 1, chunk_numel: int = CHUNK_NUMEL, cuda: bool = True
) -> int:
    """The smallest host cache the disk tier runs with: room for the pinned chunks (each the chunk size, or
    the largest block if smaller, in whole pages) and one more."""
    chunk = pages(FP32_BYTES * min(chunk_numel, largest_block))
    return (pinned_chunks(optimizer_threads, cuda) + 1) * chunk


def staging_bytes(largest_numel: int) -> int:
    """Page-locked host memory of the gradient offload's staging buffers (on CUDA)."""
    return STAGING_BUFFERS * pages(FP32_BYTES * largest_numel)


def region_bytes(blocks: list[Block]) -> int:
    """Disk bytes of one fp32 kind (e.g. the master weights) for ``blocks``."""
    return sum(pages(FP32_BYTES * b.numel) for b in blocks)


def state_bytes(blocks: list[Block], compression: str = "none") -> int:
    """Bytes of Adam m and v (and their scales) for ``blocks``."""
    fp32 = STATE_BYTES["none"]
    return int(
        sum(
            STATE_BYTES[compression] * b.large_numel + fp32 * (b.numel - b.large_numel)
            if b.repeated
            else fp32 * b.numel
            for b in blocks
        )
    )


def disk_files_bytes(blocks: list[Block], compression: str = "none", gradients: bool = True) -> int:
    """The disk tier's files: weights, m and v, and with ``gradients`` the gradient sums and per-pass sums
    of tied blocks."""
    files = region_bytes(blocks) + state_bytes(blocks, compression)
    if gradients:
        files += region_bytes(blocks) + region_bytes([b for b in blocks if len(b.sites) > 1])
    return files


def cache_bytes_for(
    blocks: list[Block],
    optimizer_threads: int,
    max_cpu_gb: float | None,
    default_bytes: int,
    chunk_numel: int = CHUNK_NUMEL,
    cuda: bool = True,
) -> int:
    """The disk tier's cache: ``max_cpu_gb`` if given (refused below :func:`min_cache_bytes`), else
    ``default_bytes`` raised to that minimum."""
    working_set = min_cache_bytes(max(b.numel for b in blocks), optimizer_threads, chunk_numel, cuda)
    if max_cpu_gb is None:
        return max(working_set, default_bytes)
    if max_cpu_gb * _GB < working_set:
        count = pinned_chunks(optimizer_threads, cuda) + 1
        raise MisconfigurationException(
            f"`max_cpu_gb={max_cpu_gb}` cannot hold the store chunks in use at once: the disk tier needs at "
            f"least {working_set / _GB:.3g} GB ({count} chunks of {working_set / count / 2**20:.3g} MB: "
            f"`io_chunk_mb`, or the largest block where it is smaller; more with more `optimizer_threads`). "
            "Raise `max_cpu_gb` to that, or lower `optimizer_threads` or `io_chunk_mb`."
        )
    return int(max_cpu_gb * _GB)
