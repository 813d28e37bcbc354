"""Host memory: page-aligned, pinned for exactly its size, unpinned when the last view is freed."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from megatrain_lightning.store import memory as hostmem


class FakeCudart:
    """Records what would be page-locked; ``fail`` makes registration fail as memlock limits do."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        if self.fail:
            return 2  # cudaErrorMemoryAllocation
        self.registered[address] = size
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        del self.registered[address]
        return 0


@pytest.fixture
def cudart(monkeypatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(hostmem, "_cudart", lambda: fake)
    monkeypatch.setattr(hostmem, "_warned", False)
    return fake


@pytest.mark.parametrize("numel", [1, 1000, 1 << 20, (1 << 20) + 1])
def test_buffers_are_page_aligned_zeroed_and_pinned_for_exactly_their_pages(cudart, numel):
    before = hostmem.pinned_bytes()
    buf = hostmem.host_empty(numel, torch.float32, pin_memory=True)
    assert buf.numel() == numel and buf.data_ptr() % hostmem.ALIGNMENT == 0
    assert torch.count_nonzero(buf) == 0
    # Never rounded to a power of two: 2^20 fp32 elements pin 4 MiB, not 8.
    assert list(cudart.registered.values()) == [hostmem.pages(4 * numel)]
    assert hostmem.pinned_bytes() - before == hostmem.pages(4 * numel)


def test_unpinned_when_the_last_view_is_freed(cudart):
    buf = hostmem.host_empty(4096, torch.float32, pin_memory=True)
    view = buf[10:20]
    del buf
    gc.collect()
    assert len(cudart.registered) == 1, "unpinned while a view still reads it"
    del view
    gc.collect()
    assert cudart.registered == {}


def test_a_failed_pin_falls_back_to_pageable_memory_with_one_warning(cudart, caplog):
    cudart.fail = True
    with caplog.at_level(logging.WARNING, logger=hostmem.__name__):
        bufs = [hostmem.host_empty(1024, torch.float32, pin_memory=True) for _ in range(3)]
    assert all(b.add_(1).sum() == 1024 for b in bufs)  # usable
    assert [r.getMessage() for r in caplog.records if "page-lock" in r.getMessage()].__len__() == 1
    assert "ulimit -l" in caplog.text


def test_unpinned_buffers_touch_no_cuda(monkeypatch):
    monkeypatch.setattr(hostmem, "_cudart", lambda: pytest.fail("pageable memory called into CUDA"))
    assert hostmem.host_empty(10, torch.uint8).numel() == 10
