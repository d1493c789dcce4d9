"""Gradient clipping where tensor parallelism puts some parameters on (dp, tp)
and the rest on dp: the training step's clip_grad_norm against torch's on the
unsharded model."""

from __future__ import annotations

import copy

import torch
from torch import nn

import flatfsdp
from flatfsdp.train.step import clip_grad_norm
from harness import run_ranks


def _reference() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.LayerNorm(8))


def _clip_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    reference = _reference()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    model = flatfsdp.fully_shard(model, device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    (model(x) ** 2).sum().backward()
    (reference(x) ** 2).sum().backward()
    meshes = {p.grad.device_mesh.mesh_dim_names for p in model.parameters()}
    total = clip_grad_norm(model.parameters(), 0.5)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    worst = max((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).sub(r.grad).abs().max().item()
                for p, r in zip(model.parameters(), reference.parameters()))
    return sorted(meshes), total.item(), expected.item(), worst


def test_clipping_across_meshes_matches_the_unsharded_model():
    for meshes, total, expected, worst in run_ranks(_clip_worker, 2):
        assert meshes == [("dp",), ("dp", "tp")]  # the case torch's own clip refuses
        assert abs(total - expected) <= 1e-5 * expected
        assert expected > 0.5  # clipping did scale the gradients
        assert worst < 1e-6
