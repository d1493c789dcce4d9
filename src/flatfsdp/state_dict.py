"""State dicts that torch.distributed.checkpoint (DCP) saves and reshards.

Between steps a sharded parameter's local tensor is a flat piece of the
flattened parameter, which DCP cannot describe. ``state_dict()`` therefore
hands out, per parameter, a DTensor in DTensor's own row layout (``Shard(0)``
with torch.chunk sizes; ``Replicate()`` for no_shard and scalars) at the true
global shape under the unsharded model's name -- built from one all-gather per
param group, so only one unit is ever whole in memory. ``load_state_dict()``
takes those (or plain full tensors) back into the flat main weights.

Optimizer state dicts are keyed by parameter name instead of position, with
the same conversion for every per-parameter state tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from flatfsdp.registry import FQN_OF, GROUP_OF, mark_weights_changed


# ---- conversion ---------------------------------------------------------------------------

def row_dtensor(full: torch.Tensor, group) -> DTensor:
    """``full`` (the same on every rank) as a DTensor in DTensor's row layout."""
    sharded = group.strategy.shards_main_weights and full.dim() > 0
    if not sharded:
        return DTensor.from_local(full.clone(), group.mesh, [Replicate()], run_check=False)
    world, rank = group.world, group.rank
    chunks = full.chunk(world, dim=0)
    local = chunks[rank].clone() if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))
    return DTensor.from_local(local, group.mesh, [Shard(0)], run_check=False, shape=full.shape,
                              stride=full.stride())


def full_value(value: Any) -> torch.Tensor:
    """A full-size plain tensor from a DTensor in any standard layout, or a tensor."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def flat_dtensor_like(sharded: nn.Parameter, full: torch.Tensor) -> DTensor:
    """A tensor shaped like ``sharded`` (a flat local piece) holding ``full``'s values."""
    group, index = GROUP_OF[sharded]
    piece = group.own_piece(full, index).to(dtype=sharded.dtype, device=group.main.device).clone()
    if not group.strategy.shards_main_weights:
        piece = piece.view(group.shapes[index])
    return DTensor.from_local(piece, group.mesh, list(sharded.placements), run_check=False,
                              shape=sharded.shape, stride=sharded.stride())


# ---- model --------------------------------------------------------------------------------

def install_state_dict_hooks(module: nn.Module) -> None:
    module.register_state_dict_post_hook(_model_state_dict)
    module.register_load_state_dict_pre_hook(_load_model_state_dict)


def _model_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    state = module._flatfsdp_state
    state.ensure_initialized()
    if state._swapped_in:
        raise RuntimeError(f"state_dict() of {type(module).__name__} while its parameters are gathered "
                           "(inside forward/backward): take state dicts between steps")
    for group in state.groups:
        full = group.gather_full([group.main[slice(*group.piece_bounds(i))] for i in range(len(group.slots))],
                                 group.main.dtype)
        for index, slot in enumerate(group.slots):
            value = row_dtensor(group.full_param(full, index), group)
            for key in slot.keys:
                state_dict[prefix + key] = value


def _load_model_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
                           missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    """Write incoming values into the flat main weights; leave the sharded
    parameter in their place so torch's own copy (and its key and shape checks)
    has nothing left to do."""
    for group in module._flatfsdp_state.groups:
        for index, (slot, sharded) in enumerate(zip(group.slots, group.sharded_params)):
            keys = [prefix + key for key in slot.keys if prefix + key in state_dict]
            if not keys:
                continue  # torch reports it missing
            value = state_dict[keys[0]]
            if tuple(value.shape) != tuple(group.shapes[index]):
                continue  # torch reports the shape mismatch
            full = full_value(value)
            with torch.no_grad():
                start, end = group.piece_bounds(index)
                group.main[start:end].copy_(group.own_piece(full, index))
            for key in keys:
                state_dict[key] = sharded
    mark_weights_changed()


# ---- optimizer ----------------------------------------------------------------------------

def install_optimizer_hooks(optimizer: torch.optim.Optimizer) -> None:
    optimizer.register_state_dict_post_hook(_optimizer_state_dict)
    optimizer.register_load_state_dict_pre_hook(_load_optimizer_state_dict)


def _ordered_params(optimizer: torch.optim.Optimizer) -> list:
    """Parameters in the order torch numbers them in optimizer state dicts."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _name(param) -> Any:
    return FQN_OF.get(param, None)


def _optimizer_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    params = _ordered_params(optimizer)
    if not any(p in GROUP_OF for p in params):
        return state_dict
    if not optimizer.state:
        # Nothing to save yet, but DCP loads in place into what state_dict()
        # returns: create the state (a zero step) so a resume has slots to fill.
        from torch.distributed.checkpoint.state_dict import _init_optim_state
        _init_optim_state(optimizer)
        state_dict = _plain_state_dict(optimizer)
    named_state = {}
    for (group, key), members in _state_by_group(params, state_dict["state"]).items():
        pieces = [None] * len(group.slots)
        for pid, index in members:
            pieces[index] = state_dict["state"][pid][key].to_local()
        full = group.gather_full(pieces, state_dict["state"][members[0][0]][key].dtype)
        for pid, index in members:
            entry = named_state.setdefault(_name(params[pid]), dict(state_dict["state"][pid]))
            entry[key] = row_dtensor(group.full_param(full, index), group)
    for pid, entry in state_dict["state"].items():
        named_state.setdefault(_name(params[pid]) or pid, dict(entry))
    groups = [dict(g, params=[_name(params[pid]) or pid for pid in g["params"]]) for g in state_dict["param_groups"]]
    return {"state": named_state, "param_groups": groups}


def _plain_state_dict(optimizer: torch.optim.Optimizer) -> dict:
    """torch's own state dict, without re-entering this hook."""
    hooks = optimizer._optimizer_state_dict_post_hooks
    saved = dict(hooks)
    hooks.clear()
    try:
        return optimizer.state_dict()
    finally:
        hooks.update(saved)


def _state_by_group(params: list, state: dict) -> dict:
    """(param group, state key) -> [(position, index in group)] for per-parameter
    tensors shaped like their parameter, in an order every rank agrees on."""
    out: dict = {}
    for pid in sorted(state):
        param = params[pid]
        if param not in GROUP_OF:
            continue
        group, index = GROUP_OF[param]
        for key, value in sorted(state[pid].items()):
            if isinstance(value, DTensor) and value.shape == param.shape:
                out.setdefault((group, key), []).append((pid, index))
    return out


def _load_optimizer_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    params = _ordered_params(optimizer)
    by_name = {_name(p): (pid, p) for pid, p in enumerate(params) if _name(p) is not None}
    if not any(isinstance(k, str) for k in state_dict["state"]) and not any(
            isinstance(n, str) for g in state_dict["param_groups"] for n in g["params"]):
        return state_dict
    state = {}
    for name, entry in state_dict["state"].items():
        if name not in by_name:
            raise KeyError(f"optimizer state for '{name}', which is not a parameter this optimizer holds")
        pid, param = by_name[name]
        state[pid] = {key: flat_dtensor_like(param, full_value(value))
                      if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0
                      else value for key, value in entry.items()}
    groups = []
    for g in state_dict["param_groups"]:
        missing = [n for n in g["params"] if n not in by_name]
        if missing:
            raise KeyError(f"optimizer param group names parameters this optimizer does not hold: {missing[:5]}")
        groups.append(dict(g, params=[by_name[n][0] for n in g["params"]]))
    return {"state": state, "param_groups": groups}
