"""Bind an optimizer built before sharding to the sharded parameters, keeping
its param groups and their hyperparameters."""

from __future__ import annotations

import torch

from flatfsdp.root_context import wait_all_reductions
from flatfsdp.state_dict import install_optimizer_hooks
from flatfsdp.registry import SHARDED_OF, is_sharded_param


def fully_shard_optimizer(optimizer: torch.optim.Optimizer, *, model: torch.nn.Module | None = None,
                          **_ignored) -> torch.optim.Optimizer:
    """Replace each original parameter in ``optimizer.param_groups`` with the
    DTensor that shards it. Nothing is stepped and no state is created.

    ``model``, when given, is the sharded model the parameters must come from.
    """
    if optimizer.state:
        raise ValueError(f"{type(optimizer).__name__} already holds state for {len(optimizer.state)} "
                         "parameters: shard before the first optimizer step")
    allowed = None
    if model is not None:
        allowed = {id(p) for p in model.parameters()}
    for gi, group in enumerate(optimizer.param_groups):
        bound = []
        for pi, param in enumerate(group["params"]):
            if is_sharded_param(param):
                sharded = param
            else:
                sharded = SHARDED_OF.get(param)
            if sharded is None or (allowed is not None and id(sharded) not in allowed):
                raise ValueError(
                    f"optimizer param_groups[{gi}]['params'][{pi}] (shape {tuple(param.shape)}, {param.dtype}) "
                    f"is not a parameter of the sharded model" + (f" {type(model).__name__}" if model else ""))
            bound.append(sharded)
        group["params"] = bound
    install_hooks(optimizer)
    return optimizer


def install_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Once per optimizer: name-keyed reshardable state dicts, and a wait for
    reductions still in flight (``sync_model_each_microbatch=False``) before a step."""
    if getattr(optimizer, "_flatfsdp_bound", False):
        return
    install_optimizer_hooks(optimizer)
    optimizer.register_step_pre_hook(lambda *_: wait_all_reductions())
    optimizer._flatfsdp_bound = True
