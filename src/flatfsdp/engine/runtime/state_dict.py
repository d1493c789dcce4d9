"""Model state dicts: the sharded parameters themselves.

``state_dict()`` holds, under the unsharded model's names, each parameter's
DTensor -- placed ``Shard(dim)`` or ``Replicate()``, local tensor its chunk of
the main weights -- exactly what the module holds between steps: no
collective, nothing beyond the local shard, and what DCP, ``full_tensor()``
and ``torch.distributed.checkpoint.state_dict`` expect.

``load_state_dict()`` accepts those, DTensors of any other placement
(redistributed: a collective), or plain full-size tensors (this rank's chunk
is copied; no collective). With ``assign=True`` the assigned DTensor objects
become the sharded parameters (as in FSDP2), viewing the engine's buffers.

A unit built on the meta device whose deferred initialisation has not run
reports those parameters as meta DTensors, placed as they will be, and
initialises nothing (FSDP2's meta model does the same): Accelerate's
``cpu_ram_efficient_loading`` reads the placements there, then loads the real
values -- which cancels the initialisation of what it loaded.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from flatfsdp.engine.layout.local_dtensor import dtensor_over
from flatfsdp.engine.runtime.meta_init import awaiting_init
from flatfsdp.engine.runtime.replaced_params import adopt_replaced_params


def install_state_dict_hooks(module: nn.Module, index: int = 0) -> None:
    """``index``: which module of its unit this is (a unit sharded as a list
    of modules has a hook on each, each seeing the keys under itself)."""
    module.register_state_dict_pre_hook(_before_state_dict)
    module.register_state_dict_post_hook(functools.partial(_sharded_values, index=index))
    module.register_load_state_dict_pre_hook(functools.partial(_to_local_placements, index=index))
    module.register_load_state_dict_post_hook(_note_loaded)


def _keys(slot, index: int) -> list[str]:
    return [key for i, key in slot.keys if i == index]


def _before_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    state = module._flatfsdp_state
    if not state.deferred.pending:
        state.ensure_initialized()


def _sharded_values(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any, *, index: int) -> None:
    """Between steps the module holds the sharded parameters already; while it
    computes (inside forward) it holds the gathered ones -- report the sharded
    ones either way."""
    state = module._flatfsdp_state
    uninitialised = awaiting_init(state)
    for group in state.groups:
        for slot, sharded in zip(group.slots, group.sharded_params):
            value = _meta_like(sharded) if id(slot.param) in uninitialised else sharded.detach()
            for key in _keys(slot, index):
                if prefix + key in state_dict:
                    state_dict[prefix + key] = value


def _meta_like(sharded: DTensor) -> DTensor:
    local = torch.empty(sharded.to_local().shape, dtype=sharded.dtype, device="meta")
    return DTensor.from_local(local, sharded.device_mesh, sharded.placements, run_check=False,
                              shape=sharded.shape, stride=sharded.stride())


def _to_local_placements(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
                         missing_keys: list, unexpected_keys: list, error_msgs: list, *, index: int) -> None:
    """Turn each incoming value into a DTensor placed like the parameter, so
    torch's own copy (and its key and shape checks) does the rest."""
    state = module._flatfsdp_state
    if not state.deferred.pending:
        state.ensure_initialized()
    for group in state.groups:
        for position, (slot, sharded) in enumerate(zip(group.slots, group.sharded_params)):
            for key in (prefix + k for k in _keys(slot, index) if prefix + k in state_dict):
                value = state_dict[key]
                if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(sharded.shape):
                    state_dict[key] = placed_like(value, sharded, group, position)
                    state.deferred.user_valued.add(id(slot.param))  # loaded: its deferred initialisation must not run
                # else: torch reports the mismatch


def placed_like(value: torch.Tensor, sharded: DTensor, group, index: int,
                dtype: torch.dtype | None = None) -> DTensor:
    """A full-size ``value`` of parameter ``index`` of ``group`` (plain, or a
    DTensor of any placement) as a DTensor placed like ``sharded``, in
    ``dtype`` (default: the sharded parameter's)."""
    dtype = dtype or sharded.dtype
    if isinstance(value, DTensor):
        if not (value.device_mesh == sharded.device_mesh and value.placements == sharded.placements):
            value = value.redistribute(sharded.device_mesh, sharded.placements)
        return value if value.dtype == dtype else value.to(dtype)
    if group.slots[index].tp is not None:
        # Tensor parallel too: DTensor cuts this rank's part of the full value
        # from the composed placements, from local data (no collective).
        chunk = distribute_tensor(value.detach().to(sharded.device), sharded.device_mesh, sharded.placements,
                                  src_data_rank=None).to_local()
    else:
        chunk = group.own_chunk_of(value.detach(), index)
    chunk = chunk.to(device=sharded.device, dtype=dtype)  # host memory where the weights are offloaded
    return dtensor_over(chunk, sharded.device_mesh, sharded.placements, shape=sharded.shape, stride=sharded.stride())


def _note_loaded(module: nn.Module, incompatible_keys) -> None:
    """After torch copied the values in -- or, with ``assign=True``, put the
    loaded DTensors in the parameters' places: those become the sharded
    parameters now (an optimizer built next must get the trained objects)."""
    state = module._flatfsdp_state
    state.deferred.user_valued |= adopt_replaced_params(state)
    for group in state.groups:
        group.note_weights_written()
