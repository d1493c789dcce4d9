"""FSDP2's N-D mesh arguments: tensor-parallel parameters whose local rows do
not split evenly over the data-parallel ranks (sharded as FSDP2 shards them,
``_StridedShard`` with uneven chunks), and ``dp_mesh_dims`` (the whole SPMD
mesh, parameters replicated on its data-parallel dimensions), each against an
unsharded reference and, where stock FSDP2 runs on CPU, against it.

One spawn per world size (4 ranks: 2 x 2; 8 ranks: 2 x 2 x 2)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed.fsdp
from torch import nn

from harness import run_ranks

TOL = 1e-5
# dp_mesh_dims is torch 2.12's; on 2.11 (the oldest torch supported) only the uneven TP tests apply.
HAS_DP_MESH_DIMS = hasattr(torch.distributed.fsdp, "DataParallelMeshDims")
needs_dp_mesh_dims = pytest.mark.skipif(not HAS_DP_MESH_DIMS, reason="torch < 2.12 has no dp_mesh_dims")
IN, HIDDEN = 6, 10  # column-parallel over 2: 5 local rows, which 2 data-parallel ranks split 3 + 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(IN, HIDDEN)
        self.down = nn.Linear(HIDDEN, IN)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(IN, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _max_diff(model, ref) -> float:
    return max((_full(p).detach() - q.detach()).abs().max().item()
               for (_, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()))


def _train(model, ref, dp_index: int, dp_ways: int, steps: int = 3, wrap=lambda x: x) -> tuple[float, float,
                                                                                               list[float]]:
    """Adam on both, the sharded model on its data-parallel slice of each batch:
    (parameter difference before training, after, the sharded model's losses)."""
    before = _max_diff(model, ref)
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(4 * dp_ways, IN, generator=gen)
        mine = wrap(x.chunk(dp_ways)[dp_index])
        loss = model(mine).pow(2).mean()
        loss = loss.to_local() if hasattr(loss, "to_local") else loss
        loss.backward()
        ref(x).pow(2).mean().backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        losses.append(loss.item())
    return before, _max_diff(model, ref), losses


def _tensor_parallel(model: Net, tp_mesh) -> Net:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def _uneven_tp(mesh, dp_names, tp_name: str, style: str):
    import flatfsdp

    model = _tensor_parallel(_net(), mesh[tp_name])
    dp_mesh = mesh[dp_names]
    if style == "fsdp2":
        for block in model.blocks:
            flatfsdp.fully_shard(block, mesh=dp_mesh)
        flatfsdp.fully_shard(model, mesh=dp_mesh)
    else:
        opt = torch.optim.Adam(model.parameters())
        outer = dict(dp_outer_dim=dp_names[0], dp_shard_dim=dp_names[1]) if len(dp_names) == 2 else \
            dict(dp_shard_dim=dp_names[0])
        model, _ = flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[Block], device_mesh=mesh, tp_dim=tp_name,
                                        **outer)
    up = model.blocks[0].up.weight
    out = dict(placements=str(up.placements), local_rows=up.to_local().shape[0])
    dp_index = dp_mesh.get_local_rank() if dp_mesh.ndim == 1 else \
        dp_mesh["rep"].get_local_rank() * 2 + dp_mesh["shard"].get_local_rank()
    out["before"], out["after"], _ = _train(model, _net(), dp_index, dp_mesh.size())
    return out


def _spmd(mesh, dims, impl: str):
    """Every parameter replicated on the whole mesh, then fully_shard with dp_mesh_dims."""
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    if impl == "flatfsdp":
        from flatfsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    model = _net()
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(distribute_tensor(param.data, mesh, [Replicate()] * mesh.ndim)))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(**dims))
    fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(**dims))
    weight = model.blocks[0].up.weight
    out = dict(placements=str(weight.placements), mesh=weight.device_mesh.mesh_dim_names)
    # The module computes with DTensors on the whole mesh (as under FSDP2), so
    # its input is one too: this rank's slice, as replicated data-parallel work.
    wrap = lambda x: DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)  # noqa: E731
    out["before"], out["after"], out["losses"] = _train(model, _net(), dist_rank(), 4, wrap=wrap)
    return out


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _spmd_refusals(mesh):
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import flatfsdp

    errors = {}
    errors["plain"] = _error(lambda: flatfsdp.fully_shard(nn.Linear(4, 4), mesh=mesh,
                                                          dp_mesh_dims=DataParallelMeshDims(shard="shard")))
    lin = nn.Linear(4, 4)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.data, mesh, [Replicate(), Shard(0)]))
    lin.bias = nn.Parameter(distribute_tensor(lin.bias.data, mesh, [Replicate(), Replicate()]))
    errors["sharded"] = _error(lambda: flatfsdp.fully_shard(lin, mesh=mesh,
                                                            dp_mesh_dims=DataParallelMeshDims(shard="shard")))
    return errors


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, NotImplementedError) as e:
        return str(e)
    return ""


def _world4(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {f"uneven_{style}": _uneven_tp(mesh, ("dp",), "tp", style) for style in ("fsdp2", "megatron")}
    if not HAS_DP_MESH_DIMS:
        return out
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    for impl in ("flatfsdp", "torch"):
        out[f"spmd_hsdp_{impl}"] = _spmd(hsdp, dict(replicate="rep", shard="shard"), impl)
        out[f"spmd_fsdp_{impl}"] = _spmd(flat, dict(shard="dp"), impl)
        out[f"spmd_ddp_{impl}"] = _spmd(flat, dict(replicate="dp"), impl)
    out["refusals"] = _spmd_refusals(hsdp)
    return out


def _world8(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("rep", "shard", "tp"))
    return {f"uneven_{style}": _uneven_tp(mesh, ("rep", "shard"), "tp", style) for style in ("fsdp2", "megatron")}


@functools.lru_cache(maxsize=None)
def _results(world: int):
    return run_ranks(_world4 if world == 4 else _world8, world, timeout=900)


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("style", ["fsdp2", "megatron"])
def test_uneven_tensor_parallel_rows_are_sharded_and_train_like_the_reference(world, style):
    results = [r[f"uneven_{style}"] for r in _results(world)]
    for r in results:
        assert r["before"] == 0.0  # full_tensor() of the uneven strided chunks is the parameter, exactly
        assert r["after"] < TOL
    # 5 local rows over 2 data-parallel shard ranks: 3 and 2, placed as FSDP2 places them.
    assert sorted({r["local_rows"] for r in results}) == [2, 3]
    assert "_StridedShard(dim=0, sf=2)" in results[0]["placements"]


@needs_dp_mesh_dims
@pytest.mark.parametrize("layout", ["hsdp", "fsdp", "ddp"])
def test_dp_mesh_dims_matches_stock_fsdp2_and_the_reference(layout):
    for r in _results(4):
        ours, stock = r[f"spmd_{layout}_flatfsdp"], r[f"spmd_{layout}_torch"]
        assert ours["before"] == 0.0 and ours["after"] < TOL
        assert ours["losses"] == pytest.approx(stock["losses"], abs=1e-6)
        assert ours["placements"] == stock["placements"]


@needs_dp_mesh_dims
def test_dp_mesh_dims_refuses_parameters_fsdp2_refuses_naming_them():
    errors = _results(4)[0]["refusals"]
    assert "parameter 'weight' is a plain tensor" in errors["plain"]
    assert "parameter 'weight' is Shard(dim=0) on data-parallel mesh dimension 'shard'" in errors["sharded"]
