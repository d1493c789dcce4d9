"""An optimizer that already stepped before sharding keeps its state.

``fully_shard(model, optimizer)`` after ``optimizer.step()`` ran on the plain
model: the optimizer's state (Adam's moments, momentum buffers, step counts)
is keyed by the original parameters, which binding replaces with the sharded
DTensors. Left there, that state would be silently dropped -- the optimizer
would start its moments from zero on parameters that are mid-training.

So binding carries it over: each state tensor shaped like its parameter
becomes a DTensor placed exactly as the sharded parameter is, holding this
rank's chunk (cut from local data: no collective, and the full-size tensor is
freed); anything else per parameter (a scalar ``step``, a non-tensor value)
is kept as it is. State of another shape (a factored second moment, say)
cannot be cut the way the parameter is: that is refused with a ValueError
naming the optimizer, the parameter and the state entry, never dropped.
"""

from __future__ import annotations

import torch

from flatfsdp.engine.layout.local_dtensor import dtensor_over
from flatfsdp.engine.runtime.state_dict import placed_like


def check_carryable(optimizer: torch.optim.Optimizer, sharded_of: dict, group_of: dict) -> None:
    """Refuse, before anything is rebound or moved, state that cannot be cut
    the way its parameter is (ValueError naming optimizer, parameter, entry)."""
    for params in (g["params"] for g in optimizer.param_groups):
        for original in params:
            sharded = sharded_of.get(id(original))
            if sharded is None or sharded is original or id(sharded) not in group_of:
                continue
            for key, value in optimizer.state.get(original, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != tuple(sharded.shape):
                    group = group_of[id(sharded)]
                    name = group.slots[_position(group, sharded)].fqn
                    kind = type(optimizer).__name__
                    raise ValueError(
                        f"{kind} holds state {key!r} of shape {tuple(value.shape)} for parameter '{name}' of shape "
                        f"{tuple(sharded.shape)}: flatfsdp cannot cut it into this rank's chunk. Build {kind} "
                        "after fully_shard, or shard before its first step")


def carry_state(optimizer: torch.optim.Optimizer, original: torch.Tensor, sharded: torch.Tensor, group) -> None:
    """Move ``optimizer``'s state for ``original`` onto ``sharded`` (a parameter
    of param group ``group``), cut to this rank's chunk (`check_carryable` first)."""
    if original is sharded or original not in optimizer.state:
        return
    old = optimizer.state.pop(original)
    position = _position(group, sharded)
    new = {}
    for key, value in old.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            new[key] = value  # a step count, a scalar: the same on every rank
            continue
        placed = placed_like(value, sharded, group, position, dtype=_state_dtype(value, sharded))
        # A chunk may be a view of the full-size state: copy it so that one is freed.
        # Where the parameter's chunk is (host memory under CPU offload), not moved to the mesh's device.
        new[key] = dtensor_over(placed.to_local().clone(), placed.device_mesh, placed.placements,
                                shape=placed.shape, stride=placed.stride())
    if new:
        optimizer.state[sharded] = new


def _position(group, sharded: torch.Tensor) -> int:
    return next(i for i, sp in enumerate(group.sharded_params) if sp is sharded)


def _state_dtype(value: torch.Tensor, sharded: torch.Tensor) -> torch.dtype:
    """Floating state follows the parameter the optimizer now steps (fp32 main
    weights under bf16 compute), as it would have been created there."""
    return sharded.dtype if value.is_floating_point() else value.dtype
