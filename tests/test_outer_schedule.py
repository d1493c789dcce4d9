"""Where the slow (inter-node) dimension's traffic happens in a step, on a
2 x 2 mesh of real gloo processes (docs/scale.md):

* HSDP: each unit's all-reduce across replicas is chained after its
  reduce-scatter and starts while backward still runs -- never all at the
  end, never with the host blocked on it in between;
* HFSDP: every unit's updated weights start across the outer dimension when
  the forward starts (all of them, in unit order) and travel while it computes;
  its outer gradient reduce-scatter is chained like HSDP's all-reduce.

Bytes and values are those of the unchained schedule: the same collectives
move the same buffers (the losses are compared with an unsharded reference
in tests/test_meshes.py; here with the same run's own replicas)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import flatfsdp
from harness import run_ranks

DIM = 64
BLOCKS = 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(DIM, DIM)

    def forward(self, x):
        return x + torch.tanh(self.w(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _outer_counts() -> dict:
    by_dim = flatfsdp.comm_account().by_dim().get("dp_outer", {})
    return {kind: v["count"] for kind, v in by_dim.items()}


def _run(layout: str, rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # bucket_bytes=0: one collective per unit, so counts are per unit.
    model, opt = flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[Block], device_mesh=mesh,
                                      dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", bucket_bytes=0,
                                      outer_dp_sharding_strategy="optim" if layout == "hfsdp" else 0)
    seen = {}

    def note(key):
        def hook(*_):
            seen.setdefault(key, _outer_counts())  # returns None: the hook changes nothing
        return hook
    # The first block's backward runs last: what the outer dimension carried by then.
    model.blocks[0].register_full_backward_pre_hook(note("bwd_last_block"))
    model.blocks[1].register_forward_pre_hook(note("fwd_second_block"))
    losses = []
    gen = torch.Generator().manual_seed(rank)
    for step in range(3):
        x = torch.randn(8, DIM, generator=gen)
        if step == 2:
            flatfsdp.comm_account().reset()
            seen.clear()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(seen=seen, total=_outer_counts(), losses=losses,
                params={n: p.full_tensor() for n, p in model.named_parameters()})


def worker(rank, world):
    return {layout: _run(layout, rank) for layout in ("hsdp", "hfsdp")}


@pytest.fixture(scope="module")
def results():
    return run_ranks(worker, 4)


def test_hsdp_all_reduces_start_during_backward(results):
    for out in results:
        hsdp = out["hsdp"]
        units = BLOCKS + 1
        assert hsdp["total"] == {"all_reduce": units}  # one per unit per step, nothing else across replicas
        # With at most two first stages in flight, each further unit's reduction
        # moves the oldest on: when the first block's backward (the last) starts,
        # blocks 5..1 have submitted theirs (the root reduces at the end: its
        # input needs no gradient), and all but the last two have their
        # all-reduces under way -- more if their reduce-scatters landed early.
        started = hsdp["seen"]["bwd_last_block"].get("all_reduce", 0)
        assert started >= (BLOCKS - 1) - 2, hsdp["seen"]
        assert "all_reduce" not in hsdp["seen"]["fwd_second_block"]  # nothing crosses replicas in forward


def test_hfsdp_weights_all_start_across_replicas_when_the_forward_starts(results):
    for out in results:
        hfsdp = out["hfsdp"]
        units = BLOCKS + 1
        # By the second block's forward every unit's outer weight gather is under way.
        assert hfsdp["seen"]["fwd_second_block"].get("all_gather", 0) == units
        assert hfsdp["total"].get("all_gather") == units and hfsdp["total"].get("reduce_scatter") == units
        started = hfsdp["seen"]["bwd_last_block"].get("reduce_scatter", 0)
        assert started >= (BLOCKS - 1) - 2, hfsdp["seen"]


def test_replicas_end_identical_and_training_progresses(results):
    for layout in ("hsdp", "hfsdp"):
        for out in results[1:]:
            for name, value in out[layout]["params"].items():
                assert torch.equal(value, results[0][layout]["params"][name]), (layout, name)
        assert all(r[layout]["losses"][-1] < r[layout]["losses"][0] for r in results)


def test_hfsdp_outer_reductions_in_flight_are_bounded():
    """Each unit's outer reduce-scatter holds its input -- the unit's
    inner-reduced chunk -- until delivered. In a fake world nothing lands
    until waited for (the slowest outer link there is), so the follow-ups
    still owed at any point in backward are what a slow link makes a rank
    hold: at most the first-stage bound plus the slack, not one per unit
    (HFSDP's peak at 64 ranks of Llama-3 8B: 16.8 GiB unbounded, 13.8 bounded)."""
    from torch.distributed.device_mesh import init_device_mesh

    from flatfsdp.engine.comm.reduction_queue import FOLLOW_UP_SLACK
    from flatfsdp.engine.comm.schedule_log import Follows, Waited
    from flatfsdp.engine.runtime.root_context import MAX_REDUCTIONS_IN_FLIGHT
    from flatfsdp.estimator.fake_world import fake_world
    from flatfsdp.estimator.schedule_trace import tracing

    blocks = 12
    with fake_world(4) as fake:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
        with fake:
            model = nn.Sequential(*(Block() for _ in range(blocks)))
            opt = torch.optim.AdamW(model.parameters())
            model, opt = flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[Block], device_mesh=mesh,
                                              dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", bucket_bytes=0,
                                              outer_dp_sharding_strategy="optim")
            x = torch.randn(8, DIM)
            with tracing() as trace:
                model(x).square().mean().backward()
            opt.step()
    owed, most = set(), 0
    for record in trace.records:
        if isinstance(record, Follows):
            owed |= set(record.tickets)
        elif isinstance(record, Waited):
            owed -= set(record.tickets)
        most = max(most, len(owed))
    assert sum(isinstance(r, Follows) for r in trace.records) == blocks  # every unit's outer stage chained
    assert 0 < most <= MAX_REDUCTIONS_IN_FLIGHT + FOLLOW_UP_SLACK
