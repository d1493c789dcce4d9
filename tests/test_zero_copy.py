"""Gathered parameters view the memory the all-gather wrote: a large
parameter's chunks are received straight into the unsharded buffer the module
computes with, and a gather copies at most this rank's own chunk (ZeRO-3: from
its sharded buffer) plus the small parameters that travel staged."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import flatfsdp
from harness import run_ranks


class CopiedBytes(TorchDispatchMode):
    """Bytes written by copy kernels (copy_, _foreach_copy_) while active."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name == "copy_":
            self.bytes += args[0].numel() * args[0].element_size()
        elif name == "_foreach_copy_":
            self.bytes += sum(t.numel() * t.element_size() for t in args[0])
        return func(*args, **(kwargs or {}))


class Unit(nn.Module):
    def __init__(self):
        super().__init__()
        self.big = nn.Linear(512, 512)   # 1 MiB: chunks received in place
        self.small = nn.LayerNorm(512)   # 4 KiB: staged

    def forward(self, x):
        return self.small(self.big(x))


def zero_copy_worker(rank, world, strategy):
    torch.manual_seed(0)
    model = nn.Sequential(Unit(), Unit())
    flatfsdp.fully_shard(model, fsdp_unit_modules=[Unit], zero_dp_strategy=strategy, bucket_bytes=0)
    unit = model[0]
    group = unit._flatfsdp_state.groups[0]
    big_index = [slot.fqn for slot in group.slots].index("big.weight")
    seen = {}

    def look(module, args):
        weight = module.big.weight
        buffer = group.buffers.unsharded.data
        start = buffer.data_ptr()
        end = start + buffer.numel() * buffer.element_size()
        seen["views_buffer"] = start <= weight.data_ptr() < end
        seen["landing"] = [v.data_ptr() for v in group.buffers.gather_codec.landing[big_index]]
        seen["rows"] = [weight[r * (512 // world)].data_ptr() for r in range(world)]

    unit.register_forward_pre_hook(look)  # after the unit's own hook has gathered it
    x = torch.randn(4, 512)
    with CopiedBytes() as copied:
        out = model(x)  # gathers both units (ZeRO-2: the kept copies are synced on first use)
    out.sum().backward()
    seen["direct"] = big_index in group.layout.direct
    big_bytes = 512 * 512 * 4
    seen["copied_fraction"] = copied.bytes / big_bytes
    return seen


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_large_chunks_land_in_the_memory_the_module_computes_with(strategy):
    world = 2
    for seen in run_ranks(zero_copy_worker, world, strategy):
        assert seen["direct"] and seen["views_buffer"]
        # Each rank's rows of the weight are where its chunk was received.
        assert seen["landing"] == seen["rows"]
        # Copies while gathering both units for forward: the small staged
        # parameters, and in ZeRO-3 this rank's own chunk of each weight (from
        # its sharded buffer). Copying the gathered weights out would add two
        # whole weights.
        own = 2 / world if strategy == "optim_grads_params" else 0.0
        assert seen["copied_fraction"] < own + 0.1, seen
