"""Turn one module into a sharded unit: collect the parameters it owns, build
its param groups, install the runtime, swap its class."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from flatfsdp.coalesce import DEFAULT_BUCKET_BYTES
from flatfsdp.fsdp_module import FSDPModule, become_fsdp_module
from flatfsdp.mesh import mesh_device
from flatfsdp.meta_init import materialize_meta
from flatfsdp.param_group import ParamGroup, ParamSlot
from flatfsdp.precision import MixedPrecisionPolicy
from flatfsdp.registry import FQN_OF, GROUP_OF, ORIGINAL_OF, SHARDED_OF, is_sharded_param
from flatfsdp.state_dict import install_state_dict_hooks
from flatfsdp.strategy import ShardingStrategy
from flatfsdp.unit_state import UnitState

def shard_unit(module: nn.Module, *, mesh: DeviceMesh, strategy: ShardingStrategy, policy: MixedPrecisionPolicy,
               reshard_after_forward: bool | None = None, average_grads: bool = True, sync_each_microbatch: bool = True,
               exclude: frozenset[int] = frozenset(), name: str = "", prefetch_bytes: int | None = None,
               bucket_bytes: int | None = None, meta_init_seed: int | None = None) -> UnitState:
    if isinstance(module, FSDPModule):
        raise ValueError(f"module '{name or type(module).__name__}' ({type(module).__name__}) is already sharded; "
                         "call fully_shard once per module")
    slots = _owned_slots(module, exclude)
    device = mesh_device(mesh)
    meta_originals: dict = {}
    pending_init = materialize_meta(module, slots, device, meta_originals)
    groups = []
    for (dtype, requires_grad), members in _group_by_dtype(slots).items():
        groups.append(ParamGroup(members, strategy=strategy, policy=policy, mesh=mesh, device=device))
    for group in groups:
        for index, (original, sharded) in enumerate(zip(group.params, group.sharded_params)):
            SHARDED_OF[original] = sharded
            ORIGINAL_OF[sharded] = original
            if original in meta_originals:
                SHARDED_OF[meta_originals[original]] = sharded
            GROUP_OF[sharded] = (group, index)
        group.use_sharded_params()
    state = UnitState(module, groups, policy=policy, reshard_after_forward=reshard_after_forward,
                      average_grads=average_grads, sync_each_microbatch=sync_each_microbatch,
                      prefetch_bytes=prefetch_bytes,
                      bucket_bytes=DEFAULT_BUCKET_BYTES if bucket_bytes is None else _checked_bucket(bucket_bytes))
    state.pending_init = pending_init
    state.init_seed = torch.initial_seed() if meta_init_seed is None else meta_init_seed
    become_fsdp_module(module, state)
    install_state_dict_hooks(module)
    _name_params_from(module)
    return state


def _checked_bucket(bucket_bytes: int) -> int:
    if not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be a non-negative number of bytes (0: never coalesce), got {bucket_bytes!r}")
    return bucket_bytes


def _name_params_from(module: nn.Module) -> None:
    """Name every sharded parameter under ``module`` by its path from ``module``;
    the outermost call (the root) has the last word, so names end up as the
    unsharded model's."""
    for path, sub in module.named_modules():
        state = getattr(sub, "_flatfsdp_state", None)
        if state is None:
            continue
        for group in state.groups:
            for slot, sharded in zip(group.slots, group.sharded_params):
                FQN_OF[sharded] = f"{path}.{slot.fqn}" if path else slot.fqn


def _owned_slots(module: nn.Module, exclude: frozenset[int]) -> list[ParamSlot]:
    """Parameters in the subtree not owned by a unit below (those already show
    as sharded DTensors) nor excluded, each with every place it is registered."""
    found: OrderedDict[int, tuple[str, nn.Parameter, list]] = OrderedDict()
    for mod_name, sub in module.named_modules(remove_duplicate=False):
        for attr, param in sub._parameters.items():
            if param is None or id(param) in exclude or is_sharded_param(param):
                continue
            if param in SHARDED_OF:
                raise _used_outside_its_unit(module, f"{mod_name}.{attr}" if mod_name else attr, param)
            fqn = f"{mod_name}.{attr}" if mod_name else attr
            entry = found.setdefault(id(param), (fqn, param, [], []))
            if not any(m is sub and a == attr for m, a in entry[2]):
                entry[2].append((sub, attr))
                entry[3].append(fqn)
    return [ParamSlot(fqn, param, tuple(locs), tuple(keys)) for fqn, param, locs, keys in found.values()]


def _group_by_dtype(slots: list[ParamSlot]) -> "OrderedDict[tuple, list[ParamSlot]]":
    groups: OrderedDict[tuple, list[ParamSlot]] = OrderedDict()
    for slot in slots:
        groups.setdefault((slot.param.dtype, slot.param.requires_grad), []).append(slot)
    return groups


def _used_outside_its_unit(module: nn.Module, fqn: str, param: nn.Parameter) -> ValueError:
    """A unit below took ``param`` while a module outside that unit still uses it."""
    owner = next((name for name, m in module.named_modules() if isinstance(m, FSDPModule)
                  and any(param is p for g in m._flatfsdp_state.groups for p in g.params)), "?")
    return ValueError(
        f"parameter '{fqn}' belongs to sharded unit '{owner}' but is also used outside it (tied weights?). "
        "Shard a module that contains every user of it, or let the root own it (the one-call "
        "fully_shard(model, ..., fsdp_unit_modules=...) does this for you).")
