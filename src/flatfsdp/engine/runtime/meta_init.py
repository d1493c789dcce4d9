"""Materialise a model built on the meta device unit by unit, each rank keeping
only its shard.

Values are made by each module's ``reset_parameters()`` under a seed derived
from (seed, the module's name in the unsharded model). That makes them
independent of rank, of world size and of the order units are sharded in, and
``reset_parameters(model, seed)`` gives the very same values to a model built
normally in one process. Initialisation waits for the first use (forward,
state_dict, unshard), when the outermost ``fully_shard`` call has named every
module; until then a unit holds only its (uninitialised) flat buffers.

A model whose weights come from elsewhere (a pretrained checkpoint written
into each rank's shard) needs no initialisation at all: ``mark_initialized``
drops it, so such modules need no ``reset_parameters()`` either -- which is
why that method is only required when initialisation actually runs.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flatfsdp.engine.layout import views


def derived_seed(seed: int, module_name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{module_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def seeded_reset(module: nn.Module, seed: int, name: str) -> None:
    # manual_seed reseeds the CPU's generator and the accelerator's: fork the
    # accelerator's too where the module initialises there, or the caller's
    # random state (dropout, sampling) would be the last module's seed after it.
    on = [p.device for p in module.parameters(recurse=False) if p.device.type not in ("cpu", "meta")]
    device_type = on[0].type if on else "cpu"
    indices = sorted({d.index if d.index is not None else torch.accelerator.current_device_index() for d in on})
    with torch.random.fork_rng(devices=indices, device_type=device_type):
        torch.manual_seed(derived_seed(seed, name))
        _reset_method(module)()


def _reset_method(module: nn.Module):
    """``reset_parameters()``, else ``_reset_parameters()``: torch's own
    MultiheadAttention (and Megatron-FSDP, which falls back to it) has only
    the private one. None: neither."""
    for name in ("reset_parameters", "_reset_parameters"):
        method = getattr(module, name, None)
        if callable(method):
            return method
    return None


def reset_parameters(model: nn.Module, seed: int) -> nn.Module:
    """Re-initialise every module that owns parameters, exactly as flatfsdp's
    meta-device initialisation does: the unsharded reference for a
    meta-initialised sharded model."""
    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            _require_reset(module, name)
            seeded_reset(module, seed, name)
    return model


def _require_reset(module: nn.Module, name: str) -> None:
    if _reset_method(module) is None:
        raise ValueError(f"module '{name or '<root>'}' ({type(module).__name__}) has parameters on the meta device "
                         "but no reset_parameters() to initialise them: give it one, build it on a real device, "
                         "or fill its weights first (flatfsdp.load_pretrained)")


def materialize_meta(units: list[nn.Module], slots: list, device: torch.device,
                     replaced: dict) -> list[tuple[int, str, nn.Module]]:
    """Give the unit's meta parameters real (uninitialised) storage, keeping
    ties, and return the modules to initialise later, in module order, each
    with the index of the unit module it is under and its path there.
    ``replaced`` collects new parameter -> the meta one it replaces (an
    optimizer built on the meta model still names the old objects)."""
    meta = {id(s.param) for s in slots if s.param.is_meta}
    if not meta:
        return []
    pending = []
    for index, name, module in ((i, n, m) for i, unit in enumerate(units) for n, m in unit.named_modules()):
        if any(id(p) in meta for p in module._parameters.values() if p is not None):
            pending.append((index, name, module))
            for key, buf in module._buffers.items():
                if buf is not None and buf.is_meta:
                    module._buffers[key] = torch.empty_like(buf, device=device)
    for i, slot in enumerate(slots):
        if slot.param.is_meta:
            real = nn.Parameter(_real_like(slot.param, device), requires_grad=slot.param.requires_grad)
            for module, attr in slot.locations:
                module._parameters[attr] = real
            replaced[real] = slot.param
            slots[i] = dataclasses.replace(slot, param=real)
    return pending


def _real_like(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Uninitialised storage for a meta parameter; a tensor-parallel (DTensor)
    one keeps its mesh and placements, with its local shard made real."""
    if isinstance(param, DTensor):
        local = torch.empty(param.to_local().shape, dtype=param.dtype, device=device)
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return torch.empty(param.shape, dtype=param.dtype, device=device)


def _require_plain(state) -> None:
    """flatfsdp initialises a meta parameter by running its module's
    reset_parameters() on a full copy; a tensor-parallel one has no full copy
    on any rank, so it must be filled by the user instead."""
    was_meta = {id(real) for real in state.deferred.meta_originals}
    for group in state.groups:
        for slot in group.slots:
            if slot.tp is not None and id(slot.param) in was_meta:
                raise NotImplementedError(
                    f"parameter '{slot.fqn}' is tensor-parallel and was built on the meta device; flatfsdp does "
                    "not run reset_parameters() on tensor-parallel shards: fill the weights "
                    "(flatfsdp.load_pretrained, or copy_ into each DTensor) and call flatfsdp.mark_initialized, "
                    "or build the tensor-parallel model on a real device")


def awaiting_init(state) -> set[int]:
    """ids of the unit's parameters that still wait for their deferred
    initialisation: built on the meta device, and since neither replaced nor
    written (loaded) by the user."""
    if not state.deferred.pending:
        return set()
    deferred = state.deferred
    return {id(real) for real in deferred.meta_originals} - deferred.user_valued - deferred.written_since_sharding(
        state.groups)


def initialize_pending(state) -> None:
    """Run the deferred ``reset_parameters()`` of a unit's modules into a
    temporary full copy of each group (main dtype), keep this rank's chunks."""
    # Only parameters that were on the meta device take the new values: a real
    # parameter in the same unit (a pretrained embedding put into a meta-built
    # model) keeps the values it was given, even when its module was reset;
    # so does one the user replaced (state.deferred.user_valued) or wrote in place
    # after sharding, e.g. to_empty on an unsharded parent then nn.init.
    was_meta = awaiting_init(state)
    owners = {id(module) for group in state.groups for slot in group.slots if id(slot.param) in was_meta
              for module, _ in slot.locations}
    pending = [entry for entry in state.deferred.pending if id(entry[2]) in owners]
    if not pending:
        state.deferred.drop()
        return
    for index, path, module in pending:  # before any change: a failed check leaves the unit as it was
        _require_reset(module, _model_name(state.paths[index], path))
    _require_plain(state)
    state.deferred.drop()
    temps, saved = [], []
    for group in state.groups:
        main = group.tensors().main_weights
        temp = torch.empty(group.layout.unsharded_numel, dtype=main.dtype, device=main.device)
        saved.append([param.data for param in group.params])  # views of the (maybe freed) model buffer
        for p, param in zip(group.layout.params, group.params):
            param.data = views.unsharded_param(temp, p)
        group.use_unsharded_params()
        temps.append(temp)
    with torch.no_grad():
        for index, path, module in pending:
            seeded_reset(module, state.deferred.seed, _model_name(state.paths[index], path))
        for group, temp, old in zip(state.groups, temps, saved):
            for index, (p, param) in enumerate(zip(group.layout.params, group.params)):
                if id(param) in was_meta:
                    group.main_chunk(index).copy_(group.own_chunk_of(views.unsharded_param(temp, p), index))
                param.data = old[index]
            group.use_sharded_params()
            group.note_weights_written()


def mark_initialized(model: nn.Module) -> nn.Module:
    """Declare that every parameter of ``model`` (sharded by flatfsdp) now holds
    its intended values, written in place into each rank's shard (e.g. by
    ``flatfsdp.load_pretrained``): the deferred meta-device initialisation of
    its units is dropped -- it would overwrite them -- and every unit re-casts
    and re-gathers its weights before their next use.

    Raises, changing nothing, where a module awaiting initialisation has
    non-persistent buffers: built on the meta device, only its initialisation
    would compute them (no checkpoint holds them)."""
    states = list({id(s): s for s in (getattr(m, "_flatfsdp_state", None) for m in model.modules())
                   if s is not None}.values())
    unfilled = [_model_name(_model_name(state.paths[index], path), name) for state in states
                for index, path, module in state.deferred.pending
                for name in sorted(module._non_persistent_buffers_set)]
    if unfilled:
        raise ValueError(f"non-persistent buffers {', '.join(unfilled)} were built on the meta device and only "
                         "initialisation computes them: build them on a real device (only parameters need the "
                         "meta device)")
    for state in states:
        state.deferred.drop()
        for group in state.groups:
            group.note_weights_written()
    return model


def _model_name(unit_path: str, path_in_unit: str) -> str:
    """A module's name in the whole model: the unit's own name, then its path in the unit."""
    if not unit_path:
        return path_in_unit
    return f"{unit_path}.{path_in_unit}" if path_in_unit else unit_path
