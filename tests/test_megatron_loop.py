"""A Megatron-LM-style training loop trains the same with flatfsdp as with
stock megatron-fsdp 0.6.1, and both as an unsharded reference.

The loop drives the model the way Megatron-LM's ``train_step`` drives a
``MegatronFSDP``: ``zero_grad_buffer()`` and ``optimizer.zero_grad(...)`` at the
start, micro-batches under ``no_sync()`` but the last, ``finish_grad_sync()``
(finalize_model_grads), ``scale_gradients(1 / micro-batches)`` (the loss is
summed over micro-batches, as with per-token losses), gradient clipping over
the parameters marked ``__fsdp_param__`` (Megatron-LM's clip_grads: the local
shard of each DTensor gradient, norms summed over the ranks), the optimizer's
Megatron-FSDP keywords, and ``start_param_sync(force_sync=True)``. The very
same function runs on both libraries: the drop-in is an import.

Stock megatron-fsdp runs on CPU in its own worker processes with the few
stand-ins below (it assumes CUDA streams and NCCL's PREMUL_SUM where no work
needs them); flatfsdp runs unpatched. megatron-fsdp is a test dependency
(``pip install --no-deps megatron-fsdp==0.6.1``, as .ci/run does).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.functional import mse_loss

from harness import run_ranks

pytest.importorskip("megatron_fsdp", reason="pip install --no-deps megatron-fsdp==0.6.1 (the test extra's note)")

D, MICRO, STEPS, MAX_NORM = 16, 2, 4, 0.5
STRATEGIES = ("optim", "optim_grads", "optim_grads_params")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, 4)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def data(rank: int) -> list:
    """STEPS x MICRO (input, target) pairs of one rank."""
    gen = torch.Generator().manual_seed(100 + rank)
    return [[(torch.randn(3, 8, generator=gen), torch.randn(3, 4, generator=gen)) for _ in range(MICRO)]
            for _ in range(STEPS)]


def megatron_clip_grad_norm(params, max_norm: float) -> float:
    """Megatron-LM's clip_grads for Megatron-FSDP parameters: the local shard
    of each marked parameter's DTensor gradient, squares summed over the data-parallel ranks."""
    grads = [p.grad._local_tensor for p in params if getattr(p, "__fsdp_param__", False) and p.grad is not None]
    total = torch.zeros(1)
    for grad in grads:
        total += grad.float().pow(2).sum()
    dist.all_reduce(total)
    norm = float(total.sqrt())
    coeff = max_norm / (norm + 1.0e-6)
    if coeff < 1.0:
        for grad in grads:
            grad.mul_(coeff)
    return norm


def megatron_lm_steps(model, optimizer, micro_batches: list) -> tuple[list, list]:
    losses, norms = [], []
    for step in micro_batches:
        model.zero_grad_buffer()
        optimizer.zero_grad(zero_grad_buffer=False)
        with model.no_sync():
            for x, y in step[:-1]:
                loss = mse_loss(model(x), y)
                loss.backward()
                losses.append(loss.item())
        x, y = step[-1]
        loss = mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        model.finish_grad_sync()
        model.scale_gradients(1.0 / len(step))
        norms.append(megatron_clip_grad_norm(model.parameters(), MAX_NORM))
        optimizer.step(sync_grad_before_optimizer_step=False, install_optimized_model_weights=True)
        model.start_param_sync(force_sync=True)
    return losses, norms


class _NoStream:
    """Stands in for a CUDA stream: work on CPU is already in order."""

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return self

    def synchronize(self, *a, **k):
        pass

    wait = query = record = synchronize


def _stock_megatron_fsdp_on_cpu():
    """megatron-fsdp 0.6.1 asks CUDA for a device index, streams and
    synchronisation, and reduces with NCCL's PREMUL_SUM; on CPU none of them
    has work to do. This worker process only."""
    import megatron_fsdp
    import megatron_fsdp.param_and_grad_buffer as pgb

    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.Stream = _NoStream
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()

    def scale_then_sum(grad_data, scaling_factor, ddp_config):  # gloo has no PREMUL_SUM
        if scaling_factor is not None and scaling_factor != 1.0:
            grad_data.mul_(scaling_factor)
        return dist.ReduceOp.SUM

    pgb.gradient_reduce_preprocessing = scale_then_sum
    pgb.validate_uneven_dtensor = lambda dtensor: None  # a check that moves the tensor to CUDA
    return megatron_fsdp


def loop_worker(rank, world, impl):
    if impl == "megatron_fsdp":
        lib = _stock_megatron_fsdp_on_cpu()
    else:
        import flatfsdp as lib
    out = {}
    for strategy in STRATEGIES:
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("fsdp", "tp"))
        net = make_net()
        model, optimizer = lib.fully_shard(
            net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), device_mesh=mesh, dp_shard_dim="fsdp",
            tp_dim="tp", fsdp_unit_modules=[Block], zero_dp_strategy=strategy, device=torch.device("cpu"),
            sync_model_each_microbatch=False, mixed_precision_policy=lib.MixedPrecisionPolicy(
                main_params_dtype=torch.float32, main_grads_dtype=torch.float32))
        out[strategy] = megatron_lm_steps(model, optimizer, data(rank))
    return out


def reference(world: int) -> tuple[list, list]:
    """One process, no sharding: each rank's micro-batches, gradients averaged
    over ranks and micro-batches, clipped by the global norm, the same SGD."""
    model = make_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    per_rank = [data(r) for r in range(world)]
    losses, norms = [[] for _ in range(world)], []
    for step in range(STEPS):
        optimizer.zero_grad()
        for r in range(world):
            for x, y in per_rank[r][step]:
                loss = mse_loss(model(x), y)
                (loss / (world * MICRO)).backward()
                losses[r].append(loss.item())
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
    return losses, norms


@pytest.fixture(scope="module")
def runs():
    return {impl: run_ranks(loop_worker, 2, impl) for impl in ("flatfsdp", "megatron_fsdp")}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_megatron_lm_loop_trains_as_stock_megatron_fsdp_and_the_reference(runs, strategy):
    ref_losses, ref_norms = reference(2)
    for rank in range(2):
        ours, ours_norms = runs["flatfsdp"][rank][strategy]
        stock, stock_norms = runs["megatron_fsdp"][rank][strategy]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref_losses[rank]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(stock), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(ours_norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(stock_norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
    assert ref_losses[0][-1] < ref_losses[0][0]  # it learns: the comparison is not of a flat line
    assert max(ref_norms) > MAX_NORM  # clipping bites at least once
