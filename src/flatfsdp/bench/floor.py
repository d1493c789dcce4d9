"""The compute floor: each rank trains its own unsharded replica on its own
rows of the batch and never communicates. Every sharded contender does this
work plus its collectives, so their step time over the floor's is the price of
sharding on this machine.

The replicas do not average gradients, so after the first step their losses
drift from the data-parallel contenders' by design; only the first loss (same
weights, same rows) is comparable.
"""

from __future__ import annotations

import copy

import torch
from torch import nn



class FloorTrainer:
    """fp32: the plain model and AdamW. bf16: a bf16 compute copy and fp32 main
    weights the optimizer steps -- the same recipe (and bytes) as the sharded
    contenders' mixed precision, without the sharding."""

    def __init__(self, model: nn.Module, make_optimizer, compute_dtype: torch.dtype) -> None:
        self.mains = list(model.parameters())
        self.mixed = compute_dtype != torch.float32
        self.compute = model
        if self.mixed:
            self.compute = _cast_copy(model, compute_dtype)
        self.compute_params = list(self.compute.parameters())
        self.optimizer = make_optimizer(self.mains)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.compute(x, targets=y)
        loss.backward()
        if self.mixed:
            for main, comp in zip(self.mains, self.compute_params):
                main.grad = comp.grad.float()
                comp.grad = None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.mixed:
            with torch.no_grad():
                torch._foreach_copy_(self.compute_params, self.mains)
        return loss.detach()


def _cast_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``copy.deepcopy(model).to(dtype)``, made so the copy is built in ``dtype``:
    deepcopy's memo hands it the cast tensors, so a tied table stays tied (and
    parameters() pair up one to one) with nothing to swap afterwards -- torch
    swaps a fake world's parameters (the estimator records this step), and a
    tied one cannot be swapped -- and a fake world's mode stays shared."""
    memo: dict = {}
    for param in model.parameters():
        mode = getattr(param, "fake_mode", None)
        if mode is not None:
            memo[id(mode)] = mode
        if param.is_floating_point():
            memo[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
    for buffer in model.buffers():
        if buffer.is_floating_point():
            memo[id(buffer)] = buffer.to(dtype)
    return copy.deepcopy(model, memo)
