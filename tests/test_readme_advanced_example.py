"""The reference README's "Advanced Features" example (Megatron-FSDP), shrunk
to a toy model on 8 CPU ranks: a 4-D mesh (dp_outer, dp_shard, cp, tp) =
(2, 2, 2, 1) with its flattened dimensions, HFSDP (outer "optim" over inner
ZeRO-3), context parallelism through dp_shard_dim="dp_shard_cp", an expert
mesh, meta-device initialisation -- every keyword of the example, trained
against an unsharded reference on the same global batch (issue 11)."""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from harness import run_ranks
from test_meshes import DIM, MLP, TOL, _batches, _full, _slice


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(MLP() for _ in range(2))
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.router = nn.Linear(DIM, 2)
        self.head = nn.Linear(DIM, 8)
        for p in self.experts.parameters():
            p.allreduce = False  # Megatron-Core's mark for expert parameters

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        gate = torch.softmax(self.router(x), dim=-1)
        x = x + sum(gate[:, e:e + 1] * torch.tanh(expert(x)) for e, expert in enumerate(self.experts))
        return self.head(x)


def _example(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from flatfsdp import fully_shard, reset_parameters

    dp_outer_size, dp_shard_size, cp_size, tp_size = 2, 2, 2, 1
    device_mesh = init_device_mesh("cpu", mesh_shape=(dp_outer_size, dp_shard_size, cp_size, tp_size),
                                   mesh_dim_names=("dp_outer", "dp_shard", "cp", "tp"))
    device_mesh[("dp_outer", "dp_shard")]._flatten("dp")
    device_mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    device_mesh[("dp_outer", "dp_shard", "cp")]._flatten("hsdp")
    hsdp_group = device_mesh["hsdp"].get_group()
    expert_device_mesh = init_device_mesh("cpu", mesh_shape=(world, 1), mesh_dim_names=("dp_shard", "tp"))

    torch.manual_seed(0)  # as training scripts do: meta initialisation follows the user's seed
    with torch.device("meta"):
        model = ToyModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = fully_shard(
        model, optimizer, device_mesh=device_mesh, dp_shard_dim="dp_shard_cp", dp_outer_dim="dp_outer",
        tp_dim="tp", hybrid_fsdp_group=hsdp_group, expt_device_mesh=expert_device_mesh, zero_dp_strategy=3,
        outer_dp_sharding_strategy=1, fsdp_unit_modules=[MLP], init_model_with_meta_device=True,
        grad_reduce_in_fp32=False, preserve_fp32_weights=True, sync_model_each_microbatch=True,
        preproc_state_dict_for_dcp_ckpt=True)
    # The reference: initialised exactly as meta-device initialisation does it.
    ref = reset_parameters(ToyModel(), torch.initial_seed())
    placements = {n: str(p.placements) for n, p in model.named_parameters()}
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    index = device_mesh["hsdp"].get_local_rank()  # a different part of the tokens on every (dp, cp) rank
    for x in _batches(3, size=16):
        model(_slice(x, index, world)).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        optimizer.step(), ref_opt.step(), optimizer.zero_grad(), ref_opt.zero_grad()
    diff = max((_full(p) - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return diff, placements, _hfsdp_beside_tensor_parallel(rank, world)


def _hfsdp_beside_tensor_parallel(rank, world):
    """2 x 2 x 2: HFSDP over (dp_outer, dp_shard) with a tensor-parallel
    dimension beside it. The data-parallel ranks are half the world, so
    every replica's transposed mesh is built together; the MLPs are
    tensor-parallel (column then row), and their DTensor parameters stay HSDP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from flatfsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_outer", "dp_shard", "tp"))
    torch.manual_seed(0)
    model = ToyModel()
    for p in model.experts.parameters():
        del p.allreduce  # no expert mesh here: ordinary parameters
    ref = copy.deepcopy(model)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = fully_shard(model, optimizer, device_mesh=mesh, dp_shard_dim="dp_shard",
                                   dp_outer_dim="dp_outer", tp_dim="tp", outer_dp_sharding_strategy="optim",
                                   fsdp_unit_modules=[MLP])
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    dp_index = mesh["dp_outer"].get_local_rank() * 2 + mesh["dp_shard"].get_local_rank()
    for x in _batches(3, size=16):
        model(_slice(x, dp_index, 4)).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        optimizer.step(), ref_opt.step(), optimizer.zero_grad(), ref_opt.zero_grad()
    diff = max((_full(p) - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return diff, {n: str(p.placements) for n, p in model.named_parameters()}


@functools.lru_cache(maxsize=1)
def _results():
    return run_ranks(_example, 8, timeout=900)


def test_the_readme_advanced_example_trains_like_the_unsharded_model():
    results = _results()
    assert max(diff for diff, _, _ in results) < TOL
    placements = results[0][1]
    # HFSDP over (dp_shard_cp=4) x (dp_outer=2): each inner chunk split into outer pieces,
    # whatever the size (the router's 2 rows leave most ranks an empty piece).
    assert placements["blocks.0.w1.weight"] == "(Shard(dim=0), Shard(dim=0))"
    assert placements["router.weight"] == "(Shard(dim=0), Shard(dim=0))"
    # Experts: their own 8-rank data-parallel mesh.
    assert placements["experts.0.weight"] == "(Shard(dim=0),)"


def test_hfsdp_beside_tensor_parallelism_at_world_8():
    results = _results()
    assert max(beside[0] for _, _, beside in results) < TOL
    placements = results[0][2][1]
    # Not tensor-parallel: split over both data-parallel dimensions, any size (2 rows over 4 ranks).
    assert placements["router.weight"] == "(Shard(dim=0), Shard(dim=0))"
    assert placements["embed.weight"] == "(Shard(dim=0), Shard(dim=0))"
    # Tensor-parallel: HSDP over (dp_outer, dp_shard), then the tp placement.
    assert placements["blocks.0.w1.weight"] == "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert placements["blocks.0.w2.weight"] == "(Replicate(), Shard(dim=0), Shard(dim=1))"
