"""The pure layer: chunks, slots, offsets and block alignment (one process, no torch.distributed)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from flatfsdp.engine.layout import views
from flatfsdp.engine.layout.arithmetic import ALIGN, build_group_layout, shard_dim_for
from flatfsdp.engine.layout.strategy import ShardingStrategy


def _random_shapes(rng: random.Random) -> list[tuple[int, ...]]:
    shapes = []
    for _ in range(rng.randint(1, 10)):
        ndim = rng.choice([1, 1, 2, 2, 3])
        shapes.append(tuple(rng.choice([1, 2, 3, 5, 7, 8, 13, 64, rng.randint(1, 40)]) for _ in range(ndim)))
    return shapes


@pytest.mark.parametrize("seed", range(200))
def test_chunks_follow_torch_chunk_and_slots_tile_each_rank(seed):
    rng = random.Random(seed)
    shapes = _random_shapes(rng)
    world = rng.choice([1, 2, 3, 4, 8])
    layout = build_group_layout(shapes, world, [0] * len(shapes), direct_min_numel=rng.choice([None, 1, 64]))
    assert layout.shard_numel % ALIGN == 0
    spans = sorted((p.local_offset, p.local_offset + p.slot) for p in layout.params)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))  # no overlap
    assert spans[-1][1] <= layout.shard_numel
    for p, shape in zip(layout.params, shapes):
        assert p.local_offset % ALIGN == 0
        reference = torch.arange(math.prod(shape)).view(shape).chunk(world, dim=0)
        for rank in range(world):
            expected = reference[rank].shape if rank < len(reference) else (0, *shape[1:])
            assert p.chunk_shape(rank) == tuple(expected), (shape, world, rank)
            assert p.chunk_numel(rank) <= p.slot
        assert sum(p.chunk_numel(r) for r in range(world)) == p.numel
    # The direct parameters sit after the staged prefix.
    for i in layout.direct:
        assert layout.params[i].local_offset >= layout.staged_numel
    for i in set(range(len(shapes))) - set(layout.direct):
        assert layout.params[i].local_offset + layout.params[i].slot <= layout.staged_numel


@pytest.mark.parametrize("seed", range(50))
def test_gathered_wire_rows_land_as_the_full_parameters(seed):
    """Rank r's local buffer holds its chunks; copying the rank-major rows into
    place gives every parameter whole, as the module computes with it."""
    rng = random.Random(seed)
    shapes = _random_shapes(rng)
    world = rng.choice([2, 3, 4])
    dims = [rng.choice([0, 1]) if len(s) == 2 and s[1] % world == 0 else 0 for s in shapes]
    layout = build_group_layout(shapes, world, dims)
    values = [torch.randn(shape) for shape in shapes]
    wire = torch.full((world, layout.shard_numel), float("nan"))
    for rank in range(world):
        for p, value in zip(layout.params, values):
            chunk = value.narrow(p.shard_dim, p.chunk_start(rank), p.chunk_length(rank))
            views.local_chunk(wire[rank], p, rank).copy_(chunk)
    unsharded = torch.zeros(layout.unsharded_numel)
    for p in layout.params:
        dst, src = views.scatter_pairs(unsharded, views.wire_slots(wire, p), p)
        dst.copy_(src)
    for p, value in zip(layout.params, values):
        assert torch.equal(views.unsharded_param(unsharded, p), value)


@pytest.mark.parametrize("seed", range(50))
def test_gradients_cut_into_the_wire_layout_reduce_to_each_ranks_chunk(seed):
    rng = random.Random(seed)
    shapes = _random_shapes(rng)
    world = rng.choice([2, 3, 4])
    layout = build_group_layout(shapes, world, [0] * len(shapes))
    grads = [torch.randn(shape) for shape in shapes]
    wire = torch.full((layout.unsharded_numel,), float("nan"))
    for p, grad in zip(layout.params, grads):
        for dst, src in zip(views.grad_destinations(wire, layout, p), views.grad_sources(grad, p)):
            dst.copy_(src)
        for pad in views.grad_padding(wire, layout, p):
            pad.zero_()
    table = wire.view(world, layout.shard_numel)
    for rank in range(world):
        for p, grad in zip(layout.params, grads):
            expected = grad.narrow(0, p.chunk_start(rank), p.chunk_length(rank))
            assert torch.equal(views.local_chunk(table[rank], p, rank), expected)
            assert not views.local_slot(table[rank], p).isnan().any()


def test_a_small_example_by_hand():
    layout = build_group_layout([(5, 3), (2,)], world=2, shard_dims=[0, 0], direct_min_numel=8)
    big, small = layout.params
    assert (big.chunk, big.slot) == (3, 9)  # rows 0-2 and 3-4 (+ one padding row)
    assert big.chunk_shape(0) == (3, 3) and big.chunk_shape(1) == (2, 3)
    assert (small.chunk, small.slot) == (1, 1)
    assert layout.direct == (0,)
    assert small.local_offset == 0 and layout.staged_numel == 8 and big.local_offset == 8
    assert layout.shard_numel == 24 and layout.unsharded_numel == 48
    assert big.unsharded_offset == 16  # rank r's rows land at 16 + 9r


def test_replicated_groups_keep_whole_parameters():
    layout = build_group_layout([(), (3, 4)], world=4, shard_dims=[None, None])
    assert layout.world == 1 and layout.unsharded_numel == layout.shard_numel
    assert [p.chunk_shape(0) for p in layout.params] == [(), (3, 4)]


def test_uneven_split_on_a_later_dimension_is_refused():
    with pytest.raises(ValueError, match="does not split evenly"):
        build_group_layout([(4, 6)], world=4, shard_dims=[1])


@pytest.mark.parametrize("shape, world, block, expected", [
    ((64, 32), 4, None, 0),
    ((), 4, None, None),            # a scalar cannot be chunked
    ((64, 32), 4, (16, 32), 0),     # 16 rows a rank: whole 16-row tiles
    ((64, 32), 3, (16, 32), None),  # 22 rows a rank straddle 16-row tiles; 32 columns do not split over 3
    ((60, 32), 4, (16, 8), 1),      # 15 rows a rank straddle; 8 columns a rank are whole tiles
    ((64, 32), 3, 256, None),       # chunks of 22 x 32 = 704 elements: not whole 256-blocks
    ((48, 32), 3, 256, 0),          # 16 x 32 = 512
    ((7,), 8, 4, None),             # one element a rank: every 4-element block straddles
    ((5, 3), 1, (2, 2), 0),         # one rank holds everything
])
def test_block_alignment_picks_a_dimension_or_none(shape, world, block, expected):
    assert shard_dim_for(shape, world, block) == expected


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
