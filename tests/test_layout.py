"""The pure layer: offsets, padding and shard ranges (one process, no torch.distributed)."""

from __future__ import annotations

import random

import pytest

from flatfsdp.layout import build_layout
from flatfsdp.strategy import ShardingStrategy


@pytest.mark.parametrize("seed", range(200))
def test_random_layouts_partition_every_parameter_exactly_once(seed):
    rng = random.Random(seed)
    numels = [rng.choice([0, 1, 3, 7, 8, 64, rng.randint(0, 5000)]) for _ in range(rng.randint(1, 12))]
    world, align = rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 4, 8])
    layout = build_layout(numels, world, align)
    assert layout.padded_numel % (world * align) == 0 or layout.padded_numel == 0
    for seg in layout.segments:
        assert seg.offset % align == 0
    ends = [0] + [s.end for s in layout.segments]
    assert all(a <= s.offset for a, s in zip(ends, layout.segments))  # no overlap, in order
    assert layout.padded_numel - sum(numels) < align * (len(numels) + world)  # padding stays small
    for index, seg in enumerate(layout.segments):
        covered = 0
        for rank in range(world):
            start, end = layout.local_piece(index, rank)
            assert 0 <= start <= end <= seg.numel
            lo, hi = layout.shard_range(rank)
            if end > start:
                assert lo <= seg.offset + start and seg.offset + end <= hi
            covered += end - start
        assert covered == seg.numel


def test_shard_ranges_tile_the_buffer():
    layout = build_layout([10, 3, 5], world_size=4, align=4)
    assert [s.offset for s in layout.segments] == [0, 12, 16]
    assert layout.padded_numel == 32 and layout.shard_numel == 8
    assert [layout.shard_range(r) for r in range(4)] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert layout.local_piece(0, 1) == (8, 10)
    assert layout.local_piece(1, 1) == (0, 3)  # [12, 15) lies inside rank 1's [8, 16)
    assert layout.local_piece(1, 2) == (3, 3)  # empty, placed at the parameter's end
    assert layout.local_piece(2, 2) == (0, 5)


@pytest.mark.parametrize("value, expected", [
    (0, ShardingStrategy.NO_SHARD), ("optim", ShardingStrategy.OPTIM), ("OPTIM_GRADS", ShardingStrategy.OPTIM_GRADS),
    (3, ShardingStrategy.OPTIM_GRADS_PARAMS), ("3", ShardingStrategy.OPTIM_GRADS_PARAMS),
])
def test_strategy_accepts_numbers_and_names(value, expected):
    assert ShardingStrategy.parse(value) is expected


@pytest.mark.parametrize("bad", [4, -1, "zero3", True, None])
def test_strategy_rejects_anything_else(bad):
    with pytest.raises((ValueError, TypeError)):
        ShardingStrategy.parse(bad)
