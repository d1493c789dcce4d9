"""Turn one module into a sharded unit: collect the parameters it owns, decide
where each lives, build its param groups, install the runtime, swap its class."""

from __future__ import annotations

import warnings
from collections import OrderedDict

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from flatfsdp.engine.coalesce import DEFAULT_BUCKET_BYTES
from flatfsdp.engine.fingerprint import check_ranks_agree, describe
from flatfsdp.engine.fsdp_module import FSDPModule, become_fsdp_module
from flatfsdp.engine.layout import shard_dim_for
from flatfsdp.engine.mesh import mesh_device
from flatfsdp.engine.meta_init import materialize_meta
from flatfsdp.engine.param_group import ParamGroup, ParamSlot
from flatfsdp.engine.placement import GroupPlacement
from flatfsdp.engine.precision import MixedPrecisionPolicy
from flatfsdp.engine.state_dict import install_state_dict_hooks
from flatfsdp.engine.strategy import ShardingStrategy
from flatfsdp.engine.tied_params import already_managed
from flatfsdp.engine.unit_state import UnitState


def shard_unit(module: nn.Module, *, mesh: DeviceMesh, strategy: ShardingStrategy, policy: MixedPrecisionPolicy,
               reshard_after_forward: bool | None = None, average_grads: bool = True, sync_each_microbatch: bool = True,
               exclude: frozenset[int] = frozenset(), name: str = "", prefetch_bytes: int | None = None,
               bucket_bytes: int | None = None, meta_init_seed: int | None = None,
               shard_block=None) -> UnitState:
    if isinstance(module, FSDPModule):
        raise ValueError(f"module '{name or type(module).__name__}' ({type(module).__name__}) is already sharded; "
                         "call fully_shard once per module")
    slots = _owned_slots(module, exclude)
    device = mesh_device(mesh)
    # Before anything else talks to the other ranks: they must be sharding the same unit.
    check_ranks_agree(describe(name or type(module).__name__, [(s.fqn, s.param) for s in slots]),
                      mesh.get_group(), device)
    slots = _choose_placements(slots, mesh, strategy, shard_block, name or type(module).__name__)
    meta_originals: dict = {}
    pending_init = materialize_meta(module, slots, device, meta_originals)
    groups = []
    for (_dtype, _grad, replicated), members in _group(slots).items():
        placement = GroupPlacement.resolve(strategy, mesh, replicate=replicated)
        groups.append(ParamGroup(members, placement=placement, policy=policy, device=device))
    for group in groups:
        group.use_sharded_params()
    state = UnitState(module, groups, policy=policy, reshard_after_forward=reshard_after_forward,
                      average_grads=average_grads, sync_each_microbatch=sync_each_microbatch,
                      prefetch_bytes=prefetch_bytes,
                      bucket_bytes=DEFAULT_BUCKET_BYTES if bucket_bytes is None else _checked_bucket(bucket_bytes))
    state.pending_init = pending_init
    state.meta_originals = meta_originals
    state.init_seed = torch.initial_seed() if meta_init_seed is None else meta_init_seed
    become_fsdp_module(module, state)
    install_state_dict_hooks(module)
    _name_units_under(module)
    return state


def _checked_bucket(bucket_bytes: int) -> int:
    if not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be a non-negative number of bytes (0: never coalesce), got {bucket_bytes!r}")
    return bucket_bytes


def _name_units_under(module: nn.Module) -> None:
    """Record every unit's path from ``module``; the outermost call (the root)
    has the last word, so paths end up as the unsharded model's names."""
    for path, sub in module.named_modules():
        if isinstance(sub, FSDPModule):
            sub._flatfsdp_state.path = path


def _owned_slots(module: nn.Module, exclude: frozenset[int]) -> list[ParamSlot]:
    """Parameters in the subtree not owned by a unit below nor excluded, each
    with every place it is registered."""
    inner = {path: sub._flatfsdp_state for path, sub in module.named_modules()
             if isinstance(sub, FSDPModule) and sub is not module}
    taken_sharded = {id(sp) for s in inner.values() for g in s.groups for sp in g.sharded_params}
    taken_original = {id(p): path for path, s in inner.items() for g in s.groups for p in g.params}
    found: OrderedDict[int, tuple[str, nn.Parameter, list, list]] = OrderedDict()
    for mod_name, sub in module.named_modules(remove_duplicate=False):
        for attr, param in sub._parameters.items():
            if param is None or id(param) in exclude or id(param) in taken_sharded:
                continue
            fqn = f"{mod_name}.{attr}" if mod_name else attr
            if id(param) in taken_original:
                raise _used_outside_its_unit(taken_original[id(param)], fqn)
            if _storage_released(param):
                # Its memory is a released gathered buffer: a unit sharded
                # before (a sibling, so not found above) owns it.
                raise already_managed(fqn, "a unit sharded earlier")
            entry = found.setdefault(id(param), (fqn, param, [], []))
            if not any(m is sub and a == attr for m, a in entry[2]):
                entry[2].append((sub, attr))
                entry[3].append(fqn)
    return [ParamSlot(fqn, param, tuple(locs), tuple(keys)) for fqn, param, locs, keys in found.values()]


def _storage_released(param: nn.Parameter) -> bool:
    if param.is_meta:
        return False
    needed = (param.storage_offset() + param.numel()) * param.element_size()
    return param.numel() > 0 and param.untyped_storage().nbytes() < needed


def _choose_placements(slots: list[ParamSlot], mesh: DeviceMesh, strategy: ShardingStrategy, shard_block,
                       unit: str) -> list[ParamSlot]:
    """Which dimension each parameter is chunked on (None: replicated)."""
    if strategy == ShardingStrategy.NO_SHARD:
        return [_with_dim(s, None) for s in slots]
    world = mesh.size()
    out, kept_whole = [], []
    for slot in slots:
        dim = shard_dim_for(tuple(slot.param.shape), world, shard_block)
        if dim is None and slot.param.dim() > 0:
            kept_whole.append(f"{slot.fqn} {tuple(slot.param.shape)}")
        out.append(_with_dim(slot, dim))
    if kept_whole:
        warnings.warn(f"unit '{unit}': no dimension of {', '.join(kept_whole)} splits over {world} ranks in whole "
                      f"shard_block={shard_block} blocks; these stay replicated (gradients all-reduced)",
                      stacklevel=4)
    return out


def _with_dim(slot: ParamSlot, dim: int | None) -> ParamSlot:
    return ParamSlot(slot.fqn, slot.param, slot.locations, slot.keys, dim)


def _group(slots: list[ParamSlot]) -> "OrderedDict[tuple, list[ParamSlot]]":
    groups: OrderedDict[tuple, list[ParamSlot]] = OrderedDict()
    for slot in slots:
        key = (slot.param.dtype, slot.param.requires_grad, slot.shard_dim is None)
        groups.setdefault(key, []).append(slot)
    return groups


def _used_outside_its_unit(owner: str, fqn: str) -> ValueError:
    """A unit below took a parameter that a module outside that unit still uses."""
    return ValueError(
        f"parameter '{fqn}' belongs to sharded unit '{owner}' but is also used outside it (tied weights?). "
        "Shard a module that contains every user of it, or let the root own it (the one-call "
        "fully_shard(model, ..., fsdp_unit_modules=...) does this for you).")
