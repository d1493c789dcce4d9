"""Pipeline parallelism over sharded stages (issue 28): torch's own
``torch.distributed.pipelining`` (PipelineStage + GPipe, 1F1B, interleaved
1F1B) drives stages whose modules were sharded by flatfsdp -- through either
front door -- on PP 2 x DP 2 (4 real ranks, gloo). Losses and final
parameters must equal an unsharded single-process model trained on the same
global batches; stock FSDP2 runs the same script (1F1B) beside them as a
check on the script itself.

torch's stage talks to the sharded modules through FSDP2's methods and, on
2.11-2.14, its private state (``fully_shard.state``; see
docs/torch_versions.md), so this file is the one to run on each torch version."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from harness import run_ranks

DIM = 8
BLOCKS = 8
GLOBAL_BATCH = 16
MICROBATCHES = 4
STEPS = 2
TOL = 1e-6
SCHEDULES = ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B"]
DOORS = ["fsdp2_style", "one_call"]
RUNS = [(schedule, door) for schedule in SCHEDULES for door in DOORS] + [("Schedule1F1B", "torch_fsdp2")]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(BLOCKS)))


def _data():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, DIM, generator=gen), torch.randn(GLOBAL_BATCH, DIM, generator=gen))
            for _ in range(STEPS)]


def _loss(out, target):
    return nn.functional.mse_loss(out, target)


def _reference():
    """Per step, the loss of every (dp rank, microbatch) piece; then the final parameters."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for x, y in _data():
        pieces = [(xm, ym) for xd, yd in zip(x.chunk(2), y.chunk(2))
                  for xm, ym in zip(xd.chunk(MICROBATCHES), yd.chunk(MICROBATCHES))]
        losses.append([_loss(model(xm), ym).item() for xm, ym in pieces])
        _loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def _shard_stage(stage: nn.Sequential, door: str, dp_mesh):
    if door == "torch_fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from flatfsdp import fully_shard
    if door == "one_call":
        return fully_shard(stage, fsdp_unit_modules=[Block], device_mesh=dp_mesh, dp_shard_dim="dp")
    for block in stage:
        fully_shard(block, mesh=dp_mesh)
    return fully_shard(stage, mesh=dp_mesh)


def _train(schedule_name: str, door: str, mesh) -> dict:
    import torch.distributed.pipelining as pipelining

    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    interleaved = schedule_name == "ScheduleInterleaved1F1B"
    n_stages = 4 if interleaved else 2
    indices = [pp, pp + 2] if interleaved else [pp]
    per_stage = BLOCKS // n_stages
    full = _model()
    modules = [_shard_stage(nn.Sequential(*full[i * per_stage:(i + 1) * per_stage]), door, mesh["dp"])
               for i in indices]
    names = [[(f"{i * per_stage + int(n.split('.')[0])}.{n.split('.', 1)[1]}", p)
              for n, p in m.named_parameters()] for i, m in zip(indices, modules)]
    stages = [pipelining.PipelineStage(m, i, n_stages, torch.device("cpu"), group=mesh.get_group("pp"))
              for i, m in zip(indices, modules)]
    cls = getattr(pipelining, schedule_name)
    schedule = cls(stages if interleaved else stages[0], n_microbatches=MICROBATCHES, loss_fn=_loss)
    opt = torch.optim.Adam([p for m in modules for p in m.parameters()], lr=1e-2)
    losses = []
    for x, y in _data():
        x, y = x.chunk(2)[dp], y.chunk(2)[dp]
        step_losses: list = []
        is_last = (n_stages - 1) in indices
        if pp == 0:
            schedule.step(x, target=y if is_last else None, losses=step_losses if is_last else None)
        else:
            schedule.step(target=y, losses=step_losses)
        losses.append([loss.item() for loss in step_losses])
        opt.step()
        opt.zero_grad()
    params = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for group in names for name, p in group}
    return dict(losses=losses if any(losses) else None, dp=dp, params=params)


def _worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    return {run: _train(*run, mesh) for run in RUNS}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_worker, 4), _reference()


@pytest.mark.parametrize("schedule,door", RUNS)
def test_pipeline_stages_train_like_the_unsharded_model(runs, schedule, door):
    ranks, (ref_losses, ref_params) = runs
    seen_losses, seen_params = 0, set()
    for rank, result in enumerate(ranks):
        run = result[(schedule, door)]
        if run["losses"] is not None:  # the ranks holding the last stage
            for step, (got, want) in enumerate(zip(run["losses"], ref_losses)):
                mine = want[run["dp"] * MICROBATCHES:(run["dp"] + 1) * MICROBATCHES]
                assert got == pytest.approx(mine, abs=TOL), (rank, step, got, mine)
            seen_losses += 1
        for name, value in run["params"].items():
            diff = (value.double() - ref_params[name].double()).abs().max().item()
            assert diff < TOL, (rank, name, diff)
            seen_params.add(name)
    assert seen_losses == 2  # both data-parallel ranks of the last stage
    assert seen_params == set(ref_params)  # every parameter lives on some stage
