"""FSDP2's own extension point for collectives -- ``set_custom_all_gather`` /
``set_custom_reduce_scatter`` with its ``AllGather`` / ``ReduceScatter`` Comm
classes -- honoured as codecs (engine/comm/user_comms.py): the user's classes
allocate the buffers and run the collectives, and training matches stock
FSDP2 running the very same classes (gloo, 2 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import flatfsdp
from harness import run_ranks
from training import batches, make_model, make_optimizer, train_sharded

STEPS = 4


def _comm_classes():
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    class CountingAllGather(AllGather):
        """What a user writes: their own allocation and their own collective."""

        def __init__(self):
            self.calls = self.allocations = 0
            self.bytes = 0

        def allocate(self, size, *, dtype, device):
            self.allocations += 1
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            self.calls += 1
            self.bytes += output_tensor.numel() * output_tensor.element_size()
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    class CountingReduceScatter(ReduceScatter):
        def __init__(self):
            self.calls = self.allocations = 0
            self.ops = set()

        def allocate(self, size, *, dtype, device):
            self.allocations += 1
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            self.calls += 1
            self.ops.add(str(op))
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    return CountingAllGather, CountingReduceScatter


def _train(fully_shard, custom: bool, rank: int, world: int, **kw):
    all_gather_cls, reduce_scatter_cls = _comm_classes()
    model = make_model()
    units = [*model.blocks, model]
    for unit in units:
        fully_shard(unit, **kw)
    ag, rs = all_gather_cls(), reduce_scatter_cls()
    if custom:
        for unit in units:
            unit.set_custom_all_gather(ag)
            unit.set_custom_reduce_scatter(rs)
    opt = make_optimizer("adamw", model.named_parameters())
    losses = train_sharded(model, opt, rank, world, batches(STEPS, seed=7))
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    return losses, full, (ag.calls, ag.allocations, ag.bytes), (rs.calls, rs.allocations, sorted(rs.ops))


def worker(rank, world):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out = {}
    for name, fn, custom in (("flatfsdp", flatfsdp.fully_shard, True), ("torch", torch_fully_shard, True),
                             ("flatfsdp-own", flatfsdp.fully_shard, False)):
        out[name] = _train(fn, custom, rank, world)
    # Block-scaled weights travel through the user's AllGather too (it moves whatever the group's codec packs).
    out["int8"] = _train(flatfsdp.fully_shard, True, rank, world, param_gather_dtype="int8")
    out["int8-own"] = _train(flatfsdp.fully_shard, False, rank, world, param_gather_dtype="int8")
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(worker, 2)


def test_the_users_classes_allocate_and_run_every_collective(results):
    for out in results:
        (ag_calls, ag_allocs, _), (rs_calls, rs_allocs, ops) = out["flatfsdp"][2], out["flatfsdp"][3]
        # 3 units (2 blocks, the root): the first step gathers all three for
        # forward and both blocks again for backward; later steps keep the
        # block that ran last gathered for its backward -- one user call per
        # unit gather, one allocation each. (FSDP2 gathers that block again: 5 a step.)
        assert ag_calls == 5 + 4 * (STEPS - 1) and ag_allocs == ag_calls
        assert out["torch"][2][0] == 5 * STEPS
        # The three units' gradients are small, so they share one reduce-scatter
        # (one bucket, as the engine's own reductions do): one user call a step,
        # input and output allocated by the user. (FSDP2 calls it per unit.)
        assert rs_calls == STEPS and rs_allocs == 2 * rs_calls
        assert ops == [str(dist.ReduceOp.AVG)]  # what FSDP2 passes for an fp32 average (see below)
        assert out["torch"][3][2] == ops


def test_training_matches_stock_fsdp2_running_the_same_classes(results):
    for out in results:
        ours, theirs = out["flatfsdp"][0], out["torch"][0]
        assert ours == theirs  # measured bit for bit: the same sums, the same averaging op
        for name, value in out["flatfsdp"][1].items():
            assert torch.allclose(value, out["torch"][1][name], rtol=1e-4, atol=1e-6), name
        assert ours[-1] < ours[0]


def test_custom_collectives_move_the_same_bytes_to_the_same_values(results):
    # The user's classes only move bytes: the run is bit for bit the engine's own.
    for out in results:
        assert out["flatfsdp"][0] == out["flatfsdp-own"][0]
        assert all(torch.equal(v, out["flatfsdp-own"][1][n]) for n, v in out["flatfsdp"][1].items())
        assert out["int8"][0] == out["int8-own"][0]
        # int8 rows: a quarter of the fp32 gathers' bytes, plus scales and the fp32 vectors.
        assert out["int8"][2][2] < 0.3 * out["flatfsdp"][2][2]
