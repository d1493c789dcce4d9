"""One optimizer step: micro-batches accumulated without communication, one
gradient reduction, clipping, the step.

Loss scaling. Averaged (the default): each micro-batch's mean token loss is
divided by the number of micro-batches and the engine averages over ranks, so
the gradient is that of the global batch's mean token loss. Per token
(--calculate-per-token-loss): backward runs on summed token losses, the engine
sums over ranks, and the gradients are divided once by the global token count
-- Megatron's recipe, exact when sequences differ in length.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.profiler import record_function



def forward_backward(model: nn.Module, batches: list[torch.Tensor], loss_fn: Callable, *,
                     per_token: bool) -> torch.Tensor:
    """Run forward/backward over ``batches`` (this rank's micro-batches) and wait
    for the gradient reductions; returns ``[sum of token losses, token count]``
    on this rank (fp64). The optimizer is not stepped: see `apply_step`."""
    totals = torch.zeros(2, dtype=torch.float64, device=batches[0].device)  # no host sync per micro-batch
    for index, batch in enumerate(batches):
        last = index == len(batches) - 1
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with (contextlib.nullcontext() if last else model.no_sync()), record_function("train::micro_batch"):
            token_losses = loss_fn(model, inputs, targets)
            tokens = targets.numel()
            scale = 1.0 if per_token else 1.0 / (tokens * len(batches))
            (token_losses * scale).backward()
        totals[0] += token_losses.detach().double()
        totals[1] += tokens
    model.finish_grad_sync()  # the finite check, clipping and per-token scaling read the reduced gradients
    return totals


def apply_step(model: nn.Module, optimizer: torch.optim.Optimizer, *, global_tokens: float, per_token: bool,
               clip_grad: float) -> None:
    """Scale (per token), clip and step; then drop the gradients."""
    if per_token:
        _divide_grads(model, global_tokens)
    if clip_grad > 0:
        clip_grad_norm(model.parameters(), clip_grad)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` also where the gradients are DTensors
    on different meshes (tensor-parallel parameters on (dp, tp), the rest on
    dp), which torch's one stacks and refuses: one norm per mesh, made whole,
    then combined, and each mesh's gradients scaled by the common factor."""
    by_mesh: dict = {}
    for param in params:
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            by_mesh.setdefault(mesh, []).append(param)
    if len(by_mesh) <= 1:
        return torch.nn.utils.clip_grad_norm_([p for group in by_mesh.values() for p in group], max_norm)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for mesh, group in by_mesh.items():
        shared = total if mesh is None else DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim, run_check=False)
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, shared)
    return total


@torch.no_grad()
def _divide_grads(model: nn.Module, count: float) -> None:
    for param in model.parameters():
        if param.grad is not None:
            param.grad.div_(count)


@torch.no_grad()
def eval_loss_sums(model: nn.Module, batches: list[torch.Tensor], loss_fn: Callable) -> torch.Tensor:
    """``[sum of token losses, token count]`` over this rank's evaluation batches."""
    totals = torch.zeros(2, dtype=torch.float64, device=batches[0].device)
    with record_function("train::eval"):
        for batch in batches:
            targets = batch[:, 1:]
            totals[0] += loss_fn(model, batch[:, :-1], targets).double()
            totals[1] += targets.numel()
    return totals
