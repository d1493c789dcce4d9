"""Parameters the user replaced between ``fully_shard`` and the unit's first use.

FSDP2 allows ``module.weight = nn.Parameter(value)`` after sharding and before
the first forward (e.g. a value computed from other, already sharded weights):
its lazy initialisation shards the new value. Here the unit takes the value
into its main weights (this rank's chunk of it) and puts its own sharded
parameter back in place. Without this the assignment would be silently
dropped: the unit re-registers its own parameters at every gather.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def adopt_replaced_params(state) -> set[int]:
    """Take every replaced parameter of ``state``'s unit into its groups;
    return the ids of the unit's original parameters whose values now come
    from the user (their deferred meta-device initialisation must not run)."""
    adopted: set[int] = set()
    for group in state.groups:
        for index, (slot, sharded) in enumerate(zip(group.slots, group.sharded_params)):
            for module, attr in slot.locations:
                current = module._parameters.get(attr)
                if current is None or current is sharded or current is group.params[index]:
                    continue
                _check_compatible(slot, sharded, current)
                with torch.no_grad():
                    group.main_chunk(index).copy_(_own_chunk(group, index, sharded, current))
                if isinstance(current, DTensor):
                    # FSDP2 keeps the new DTensor object as the sharded parameter: so does this.
                    group.adopt_sharded_param(index, current)
                    sharded = current
                else:
                    # A plain tensor cannot become a DTensor in place: the unit's
                    # own parameter takes its value, and an optimizer built on
                    # the plain one is caught as stale (stale_optimizers).
                    sharded.requires_grad_(current.requires_grad)
                    name = f"{state.path}.{slot.fqn}" if state.path else slot.fqn
                    state.deferred.orphaned[id(current)] = (current, name)
                for holder, holder_attr in slot.locations:
                    holder._parameters[holder_attr] = sharded
                adopted.add(id(slot.param))
    if adopted:
        for group in state.groups:
            group.note_weights_written()
    return adopted


def _check_compatible(slot, sharded: torch.Tensor, value: torch.Tensor) -> None:
    if slot.tp is not None:
        raise NotImplementedError(f"parameter '{slot.fqn}' is tensor-parallel and was replaced after fully_shard: "
                                  "write the new value into the existing parameter (copy_) instead")
    if tuple(value.shape) != tuple(sharded.shape) or value.dtype != sharded.dtype:
        raise ValueError(f"parameter '{slot.fqn}' was replaced after fully_shard by a tensor of shape "
                         f"{tuple(value.shape)} and dtype {value.dtype}; the sharded unit holds shape "
                         f"{tuple(sharded.shape)} and dtype {sharded.dtype}: replace it before fully_shard, "
                         "or assign a value of the same shape and dtype")


def _own_chunk(group, index: int, sharded: DTensor, value: torch.Tensor) -> torch.Tensor:
    """This rank's part of the new value: a DTensor placed as the sharded
    parameter is gives its local tensor as it is; any other is made whole
    first (a collective: every rank adopts in the same order)."""
    if isinstance(value, DTensor):
        local = value.to_local()
        if (value.device_mesh == sharded.device_mesh and value.placements == sharded.placements
                and local.shape == group.main_chunk(index).shape):
            return local
        value = value.full_tensor()
    return group.own_chunk_of(value.detach().to(sharded.device), index)
