"""The disk tier's cache memory: regions of one buffer, reused without new allocations."""

from __future__ import annotations

from megatrain_lightning.store.arena import Arena
from megatrain_lightning.store.memory import ALIGNMENT

PAGE = ALIGNMENT
MB = 1 << 20


def test_regions_come_from_one_buffer_and_freed_ones_merge():
    arena = Arena(8 * MB + 100)
    assert arena.capacity == 8 * MB  # rounded down: never above the budget
    a, b, c = (arena.allocate(2 * MB) for _ in range(3))
    assert (a, b, c) == (0, 2 * MB, 4 * MB) and arena.used == 6 * MB
    assert arena.allocate(4 * MB) is None  # 2 MB left
    arena.release(b, 2 * MB)
    arena.release(a, 2 * MB)
    assert list(arena.gaps()) == [(0, 4 * MB), (6 * MB, 8 * MB)]
    assert arena.allocate(4 * MB) == 0  # the two freed neighbours merged
    region = arena.region(c, 2 * MB)
    assert region.data_ptr() == arena.memory.data_ptr() + c and region.data_ptr() % PAGE == 0


def test_small_regions_are_placed_from_the_top():
    arena = Arena(8 * MB)
    small = arena.allocate(PAGE)
    large = arena.allocate(4 * MB)
    assert small == 8 * MB - PAGE and large == 0
    arena.release(large, 4 * MB)
    assert arena.allocate(8 * MB - PAGE) == 0  # the small one did not split the space


def test_allocate_at_takes_an_exact_window():
    arena = Arena(4 * MB)
    arena.allocate_at(MB, MB)
    assert list(arena.gaps()) == [(0, MB), (2 * MB, 4 * MB)] and arena.used == MB
    arena.release(MB, MB)
    assert list(arena.gaps()) == [(0, 4 * MB)] and arena.used == 0


def test_an_empty_region_takes_no_space_even_when_full():
    arena = Arena(MB)
    assert arena.allocate(MB) == 0
    assert arena.allocate(0) == 0 and arena.used == MB
    arena.release(0, 0)
    assert list(arena.gaps()) == [] and arena.used == MB
