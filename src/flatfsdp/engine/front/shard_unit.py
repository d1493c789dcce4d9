"""Turn one module into a sharded unit: collect the parameters it owns, decide
where each lives, build its param groups, install the runtime, swap its class."""

from __future__ import annotations

import dataclasses
import warnings
from collections import OrderedDict
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from flatfsdp.engine.comm.fingerprint import (check_ranks_agree, describe, take_first_replica, value_check_mode,
                                              warn_first_replica_taken)
from flatfsdp.engine.runtime.fsdp_module import FSDPModule, become_fsdp_module
from flatfsdp.engine.layout.arithmetic import shard_dim_for
from flatfsdp.engine.layout.mesh import DataParallelMesh, data_parallel_dims, mesh_device
from flatfsdp.engine.runtime.meta_init import materialize_meta
from flatfsdp.engine.groups.param_group import ParamGroup
from flatfsdp.engine.groups.slots import ParamSlot
from flatfsdp.engine.groups.subclass_group import SubclassGroup
from flatfsdp.engine.front.subclass_check import check_subclass_params, protocol_slots
from flatfsdp.engine.layout.placement import GroupPlacement, TensorParallelSpec
from flatfsdp.engine.layout.options import ShardOptions
from flatfsdp.engine.runtime.state_dict import install_state_dict_hooks
from flatfsdp.engine.layout.strategy import ShardingStrategy
from flatfsdp.engine.runtime.tied_params import already_managed
from flatfsdp.engine.runtime.deferred_init import DeferredInit
from flatfsdp.engine.runtime.unit_state import UnitState


def shard_unit(modules: nn.Module | list[nn.Module], options: ShardOptions, *, name: str = "",
               exclude: frozenset[int] = frozenset()) -> UnitState:
    """Shard one unit: a module, or several modules that run as one (a list),
    as ``options`` say (layout/options.py). ``exclude``: ids of parameters an
    outer unit owns (tied weights), besides the ignored ones.

    ``shard_placement_fn(param) -> Shard(dim) | None`` picks each parameter's
    dimension (FSDP2's argument); ``require_shardable`` refuses scalar and
    non-contiguous parameters as FSDP2 does instead of replicating them.
    Expert parameters (Megatron-Core marks them ``allreduce=False``) are
    sharded over ``expert_mesh`` when one is given. ``main_home``: where main
    weights and gradients live (layout/main_home.py). ``replica_values``: "error" or
    "warn" when data-parallel replicas start from different weights
    (comm/fingerprint.py; FLATFSDP_CHECK_REPLICAS overrides)."""
    mesh, expert_mesh, strategy, policy = options.mesh, options.expert_mesh, options.strategy, options.policy
    exclude = exclude | options.ignored
    units = list(modules) if isinstance(modules, (list, tuple)) else [modules]
    label = name or ", ".join(type(m).__name__ for m in units)
    _check_units(units, label)
    slots, conflicts = _owned_slots(units, exclude)
    if options.require_shardable:
        _refuse_unshardable(slots, label)
    device = mesh_device(mesh.shard)
    # Local checks of how DTensor parameters are placed come first: a refused
    # placement is named as such, not as replicas that differ.
    slots = [_with_tensor_parallel(s, label, mesh) for s in slots]
    _check_replicas(label, slots, options, device)
    slots, experts = _placed(slots, options, label)
    meshes = {False: mesh, True: expert_mesh}
    protocol = protocol_slots(slots)
    meta_originals: dict = {}
    pending_init = materialize_meta(units, slots, device, meta_originals)
    own_dtype = {s.fqn for s in slots if policy.keeps_original_dtype(s.param, s.fqn)}
    groups = []
    for key, members in _group(slots, experts, mesh, own_dtype, protocol).items():
        tp_mesh = members[0].tp.mesh if members[0].tp is not None else None
        placement = GroupPlacement.resolve(strategy, meshes[key.expert], replicate=key.replicated, tp_mesh=tp_mesh,
                                           hybrid=key.hybrid)
        group_policy = policy.for_original_dtype() if key.own_dtype else policy
        if key.gathers_itself:  # gathered through the parameters' own class (subclass_group)
            groups.append(SubclassGroup(members, placement=placement, policy=group_policy, device=device,
                                        transport=options.switches.transport))
        else:
            groups.append(ParamGroup(members, placement=placement, policy=group_policy, device=device,
                                     transport=options.switches.transport, home=options.main_home))
    for group in groups:
        group.use_sharded_params()
    seed = options.meta_init_seed if options.meta_init_seed is not None else _agreed_seed(mesh, device, pending_init)
    deferred = DeferredInit(pending=pending_init, meta_originals=meta_originals, seed=seed, conflicts=conflicts)
    deferred.note_baseline(groups)
    state = UnitState(units, groups, options, deferred)
    for index, module in enumerate(units):
        become_fsdp_module(module, state)
        install_state_dict_hooks(module, index)
    for module in units:
        _name_units_under(module)
    return state


def replica_groups(mesh: DataParallelMesh) -> list:
    """The data-parallel dimensions with more than one rank (whose ranks hold
    replicas, or chunks, of the same parameters)."""
    return [dim for dim in (mesh.shard, mesh.outer) if dim is not None and dim.size() > 1]


def _check_replicas(label: str, slots: list[ParamSlot], options: ShardOptions, device: torch.device) -> None:
    """Before anything else talks to the other ranks: they must be sharding
    the same unit, from the same values (per ``replica_values``; the first
    rank's taken where it says "broadcast"). Expert parameters hold a
    different expert on each expert-parallel rank, so their values are left out."""
    description = describe(label, [(s.fqn, s.param) for s in slots])
    values = [(s.fqn, s.param) for s in slots if options.expert_mesh is None or not is_expert(s.param)]
    values_differ = value_check_mode(options.replica_values, options.switches.check_replicas)
    dims = replica_groups(options.mesh)
    if values_differ == "broadcast":
        found = take_first_replica(label, values, [dim.get_group() for dim in dims], device)
        if found:
            warn_first_replica_taken(found, stacklevel=5)
        values_differ = "skip"
    for dim in dims:
        check_ranks_agree(description, dim.get_group(), device, values, values_differ)


def _placed(slots: list[ParamSlot], options: ShardOptions, label: str) -> tuple[list[ParamSlot], set[str]]:
    """Each parameter with the dimension it is chunked on, over its mesh
    (expert parameters over ``expert_mesh``), subclass parameters checked
    against it; and the expert parameters' names (by name: meta-device
    materialisation replaces the parameter objects)."""
    mesh, expert_mesh = options.mesh, options.expert_mesh
    experts = {s.fqn for s in slots if expert_mesh is not None and is_expert(s.param)}
    placed = []
    for expert, dp_mesh in ((False, mesh), (True, expert_mesh)):
        mine = _choose_placements([s for s in slots if (s.fqn in experts) == expert], dp_mesh, options.strategy,
                                  options.shard_block, options.shard_placement_fn, label)
        check_subclass_params(mine, unit=label, world=(dp_mesh or mesh).shard.size(),
                              home=options.main_home)
        placed += mine
    return placed, experts


def _agreed_seed(mesh: DataParallelMesh, device: torch.device, pending_init: list) -> int:
    """The seed meta-device initialisation uses when none is given: this
    process's ``torch.initial_seed()``, which torch draws at random per
    process unless the user seeds it -- so the first data-parallel rank's,
    or ranks would initialise their chunks (and replicas) from different seeds."""
    seed = torch.initial_seed() & 0x7FFF_FFFF_FFFF_FFFF
    if not pending_init:
        return seed
    value = torch.tensor([seed], dtype=torch.int64, device=device)
    for dim in replica_groups(mesh):
        torch.distributed.broadcast(value, group=dim.get_group(), group_src=0)
    return int(value.item())


def _check_units(units: list[nn.Module], label: str) -> None:
    if not units:
        raise ValueError("fully_shard got an empty list of modules")
    for module in units:
        if not isinstance(module, nn.Module):
            raise TypeError(f"fully_shard takes an nn.Module or a list of them, got {type(module).__name__}")
        if isinstance(module, FSDPModule):
            raise ValueError(f"module '{label}' ({type(module).__name__}) is already sharded; "
                             "call fully_shard once per module")
    if len({id(m) for m in units}) != len(units):
        raise ValueError(f"fully_shard([...]) got the same module twice ({label})")


def _refuse_unshardable(slots: list[ParamSlot], unit: str) -> None:
    for slot in slots:
        if slot.param.dim() == 0:
            raise ValueError(f"unit '{unit}': parameter '{slot.fqn}' is a scalar, which cannot be sharded. "
                             f"Change {slot.fqn.rsplit('.', 1)[-1]} to a 1D tensor with numel equal to 1.")
        if not slot.param.is_meta and not slot.param.is_contiguous():
            raise NotImplementedError(
                f"FSDP does not support non-contiguous parameters yet: unit '{unit}', parameter '{slot.fqn}' "
                f"(shape {tuple(slot.param.shape)}, stride {slot.param.stride()}); make it contiguous first")


def _name_units_under(module: nn.Module) -> None:
    """Record every unit module's path from ``module``; the outermost call (the
    root) has the last word, so paths end up as the unsharded model's names."""
    for path, sub in module.named_modules():
        if isinstance(sub, FSDPModule):
            state = sub._flatfsdp_state
            state.paths[state.index_of(sub)] = path


def _owned_slots(units: list[nn.Module], exclude: frozenset[int]) -> tuple[list[ParamSlot], list[tuple[int, ValueError]]]:
    """Parameters in the units' subtrees not owned by a unit below nor
    excluded, each with every place it is registered and its state-dict key
    under each unit module (``(module index, key)``); and the error for each
    parameter a sibling unit sharded already (raised at the first forward,
    where FSDP2 raises it: sharding may still be under way until then)."""
    grouped = len(units) > 1
    inner = {f"[{i}].{path}" if grouped else path: sub._flatfsdp_state for i, unit in enumerate(units)
             for path, sub in unit.named_modules() if isinstance(sub, FSDPModule) and sub is not unit}
    taken_sharded = {id(sp) for s in inner.values() for g in s.groups for sp in g.sharded_params}
    taken_original = {id(p): path for path, s in inner.items() for g in s.groups for p in g.params}
    found: OrderedDict[int, tuple[str, nn.Parameter, list, list]] = OrderedDict()
    conflicts: list[tuple[int, ValueError]] = []
    deferred = {pid for s in inner.values() for pid in s.deferred.conflicted}  # reported by the unit below
    for index, unit in enumerate(units):
        for mod_name, sub in unit.named_modules(remove_duplicate=False):
            for attr, param in sub._parameters.items():
                if param is None or id(param) in exclude or id(param) in taken_sharded or id(param) in deferred:
                    continue
                key = f"{mod_name}.{attr}" if mod_name else attr
                fqn = f"[{index}].{key}" if grouped else key
                if id(param) in taken_original:
                    raise _used_outside_its_unit(taken_original[id(param)], fqn)
                if _storage_released(param):
                    # Its memory is a released gathered buffer: a unit sharded
                    # before (a sibling, so not found above) owns it.
                    conflicts.append((id(param), already_managed(fqn, "a unit sharded earlier")))
                    continue
                entry = found.setdefault(id(param), (fqn, param, [], []))
                if not any(m is sub and a == attr for m, a in entry[2]):
                    entry[2].append((sub, attr))
                    entry[3].append((index, key))
    return [ParamSlot(fqn, param, tuple(locs), tuple(keys)) for fqn, param, locs, keys in found.values()], conflicts


def _storage_released(param: nn.Parameter) -> bool:
    if param.is_meta:
        return False
    needed = (param.storage_offset() + param.numel()) * param.element_size()
    return param.numel() > 0 and param.untyped_storage().nbytes() < needed


def _choose_placements(slots: list[ParamSlot], mesh: DataParallelMesh, strategy: ShardingStrategy, shard_block,
                       placement_fn, unit: str) -> list[ParamSlot]:
    """Which dimension each parameter is chunked on (None: replicated)."""
    if not slots:
        return []
    if strategy == ShardingStrategy.NO_SHARD:
        return [s.with_dim(None) for s in slots]
    if placement_fn is not None and shard_block is not None:
        raise ValueError(f"unit '{unit}': pass shard_placement_fn or shard_block, not both")
    world = mesh.shard.size()
    out, kept_whole = [], []
    for slot in slots:
        dim = _chosen_dim(placement_fn, slot, world, unit) if placement_fn is not None else None
        if dim is None:
            dim = shard_dim_for(slot.local_shape, world, shard_block)
        if dim is None and slot.param.dim() > 0:
            kept_whole.append(f"{slot.fqn} {slot.local_shape}")
        out.append(slot.with_dim(dim))
    if kept_whole:
        warnings.warn(f"unit '{unit}': no dimension of {', '.join(kept_whole)} splits over {world} ranks in whole "
                      f"shard_block={shard_block} blocks; these stay replicated (gradients all-reduced)",
                      stacklevel=6)
    return out


def _chosen_dim(placement_fn, slot: ParamSlot, world: int, unit: str) -> int | None:
    """The dimension ``shard_placement_fn`` asks for (None: the default)."""
    choice = placement_fn(slot.param)
    if choice is None:
        return None
    if not isinstance(choice, Shard):
        raise TypeError(f"unit '{unit}': shard_placement_fn returned {choice!r} for '{slot.fqn}'; "
                        "expected Shard(dim) or None")
    ndim, shape = slot.param.dim(), slot.local_shape
    dim = choice.dim + ndim if choice.dim < 0 else choice.dim
    if not 0 <= dim < max(ndim, 1):
        raise PlacementError(f"Shard dim {choice.dim} is invalid for {ndim}D tensor: unit '{unit}', parameter "
                             f"'{slot.fqn}' of shape {shape}")
    if dim > 0 and shape[dim] % world:
        raise PlacementError(f"unit '{unit}': parameter '{slot.fqn}' of shape {shape} is asked to "
                             f"shard on dim {dim}, whose size does not split evenly over {world} ranks "
                             "(only dim 0 may be chunked unevenly)")
    return dim


class PlacementError(ValueError, AssertionError):
    """A shard placement that cannot hold the parameter. (Also an
    AssertionError: FSDP2 raises one here, and code written for it catches that.)"""


def _with_tensor_parallel(slot: ParamSlot, unit: str, mesh: DataParallelMesh) -> ParamSlot:
    """Record how a DTensor parameter (tensor / sequence parallel) is placed;
    flatfsdp shards its local tensor."""
    param = slot.param
    if not isinstance(param, DTensor):
        return slot
    dp_dims = data_parallel_dims(param.device_mesh, mesh)
    for index in dp_dims:
        if not isinstance(param.placements[index], Replicate):
            raise PlacementError(f"unit '{unit}': parameter '{slot.fqn}' is {param.placements[index]!r} on "
                                 f"data-parallel mesh dimension '{param.device_mesh.mesh_dim_names[index]}'; it "
                                 "must be Replicate() there (fully_shard does the sharding)")
    spec = TensorParallelSpec(param.device_mesh, tuple(param.placements), param.shape, dp_dims)
    return dataclasses.replace(slot, tp=spec)


def is_expert(param: nn.Parameter) -> bool:
    """Megatron-Core marks expert parameters ``allreduce = False`` (their
    gradients are reduced over the expert data-parallel group only)."""
    return getattr(param, "allreduce", True) is False


class GroupKey(NamedTuple):
    """What the parameters of one param group share."""

    dtype: torch.dtype
    requires_grad: bool
    replicated: bool
    """No dimension is chunked (NO_SHARD, scalars, unsplittable blocks)."""
    tp_mesh: int | None
    """id of the tensor-parallel mesh of DTensor parameters (None: plain)."""
    expert: bool
    """Sharded over the expert data-parallel mesh."""
    hybrid: bool
    """HFSDP: main weights split across the outer dimension too."""
    own_dtype: bool
    """Kept in its own dtype by ``param_dtype_override_fn``."""
    gathers_itself: bool
    """A tensor subclass gathered through FSDP2's extension (subclass_group)."""


def _group(slots: list[ParamSlot], experts: set[str], mesh: DataParallelMesh,
           own_dtype: set[str], protocol: set[str]) -> "OrderedDict[GroupKey, list[ParamSlot]]":
    groups: OrderedDict[GroupKey, list[ParamSlot]] = OrderedDict()
    for slot in slots:
        tp_mesh = id(slot.tp.mesh) if slot.tp is not None else None
        expert, own = slot.fqn in experts, slot.fqn in protocol
        # HFSDP for what is chunked on dim 0 (see groups/replicas.py); the rest --
        # replicated, column-chunked, tensor-parallel or a subclass -- stays HSDP.
        hybrid = (mesh.replicas_split_optimizer and not expert and slot.tp is None and slot.shard_dim == 0
                  and not own)
        key = GroupKey(slot.param.dtype, slot.param.requires_grad, slot.shard_dim is None, tp_mesh, expert, hybrid,
                       slot.fqn in own_dtype, own)
        groups.setdefault(key, []).append(slot)
    return groups


def _used_outside_its_unit(owner: str, fqn: str) -> ValueError:
    """A unit below took a parameter that a module outside that unit still uses."""
    return ValueError(
        f"parameter '{fqn}' belongs to sharded unit '{owner}' but is also used outside it (tied weights?). "
        "Shard a module that contains every user of it, or let the root own it (the one-call "
        "fully_shard(model, ..., fsdp_unit_modules=...) does this for you).")
