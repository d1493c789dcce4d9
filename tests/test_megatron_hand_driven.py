"""Megatron-Core's expert-parallel all-to-all overlap schedule on a MegatronFSDP:
the layers driven by hand.

``combined_1f1b.py`` (``overlap_moe_expert_parallel_comm``) never calls a
layer's forward: it calls ``_replace_param_with_raw_if_needed()``, then the
layers' sub-modules itself, one micro-batch's forward before the previous
one's backward, each backward between ``pre_backward()`` and
``post_backward()``, the release members after each layer; Megatron-Core's
``finalize_model_grads`` calls ``finish_grad_sync()`` before the step. Here
that sequence is played on two ranks (ZeRO-3 and ZeRO-1, gradients reduced
each micro-batch or only at the end) and the weights after two steps are
compared with an unsharded model trained on the same micro-batches; a plain
forward afterwards sees the stepped weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from harness import run_ranks

D, MICRO, STEPS = 8, 2, 2
CASES = [("optim_grads_params", True), ("optim_grads_params", False), ("optim", True)]


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):  # never called by the schedule
        return x + self.mlp(torch.tanh(self.attn(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(3, D)
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def by_hand(net: Net, x: torch.Tensor) -> torch.Tensor:
    """The schedule's way: each layer's sub-modules, not the layer."""
    h = net.inp(x)
    for layer in net.layers:
        h = h + layer.mlp(torch.tanh(layer.attn(h)))
    return net.head(h)


def micro_batches(step: int, rank: int, world: int) -> list:
    gen = torch.Generator().manual_seed(50 + step)
    batches = [(torch.randn(4 * world, 3, generator=gen), torch.randn(4 * world, 1, generator=gen))
               for _ in range(MICRO)]
    return [(x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]) for x, y in batches] if rank >= 0 else batches


def loss_of(out, y):
    return nn.functional.mse_loss(out, y) / MICRO


def worker(rank, world):
    import flatfsdp.megatron_fsdp as megatron_fsdp

    out = {}
    for strategy, auto_sync in CASES:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        model = megatron_fsdp.fully_shard_model(Net(), device_mesh=mesh, dp_shard_dim="dp", fsdp_unit_modules=[Layer],
                                                zero_dp_strategy=strategy, device=torch.device("cpu"),
                                                sync_model_each_microbatch=auto_sync)
        optimizer = megatron_fsdp.fully_shard_optimizer(torch.optim.Adam(model.parameters(), lr=0.05))
        inner = model.module
        for step in range(STEPS):
            (x1, y1), (x2, y2) = micro_batches(step, rank, world)
            model._replace_param_with_raw_if_needed()
            first = loss_of(by_hand(inner, x1), y1)
            for layer in inner.layers:
                model.post_forward_release_module(layer)
            second = loss_of(by_hand(inner, x2), y2)  # the next micro-batch's forward, before the first's backward
            model.pre_backward()
            first.backward()
            model.post_backward()
            for layer in inner.layers:
                model.post_backward_release_module(layer)
            model.pre_backward()
            second.backward()
            model.post_backward()
            model.finish_grad_sync()
            optimizer.step()
            optimizer.zero_grad()
        x, _ = micro_batches(STEPS, rank, world)[0]
        out[(strategy, auto_sync)] = ({n: p.full_tensor() for n, p in model.named_parameters()},
                                      model(x).detach(), x)
    return out


def reference() -> tuple[dict, Net]:
    net = Net()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.05)
    for step in range(STEPS):
        for x, y in micro_batches(step, -1, 2):
            loss_of(net(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {f"module.{n}": p.detach() for n, p in net.named_parameters()}, net


@pytest.fixture(scope="module")
def runs():
    return run_ranks(worker, 2)[0]


@pytest.mark.parametrize("strategy, auto_sync", CASES)
def test_a_step_driven_by_hand_trains_as_the_unsharded_model(runs, strategy, auto_sync):
    weights, net = reference()
    got, output, x = runs[(strategy, auto_sync)]
    assert got.keys() == weights.keys()
    for name, value in weights.items():
        assert torch.allclose(got[name], value, atol=1e-6), (strategy, auto_sync, name)
    assert torch.allclose(output, net(x).detach(), atol=1e-6)  # a plain forward after it: the stepped weights
