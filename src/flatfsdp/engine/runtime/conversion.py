"""``module.to(dtype)``, ``.to(device)``, ``.to_empty()``, ``.double()`` ... after
sharding: torch converts the sharded parameters it finds on the module, and
the unit then takes the converted values back into its own buffers, rebuilding
a param group when its dtype or device changed, so the module stays sharded
(and its parameters keep viewing the engine's buffers)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flatfsdp.engine.groups.param_group import ParamGroup
from flatfsdp.engine.runtime.class_swap import reswap, unswap
from flatfsdp.engine.layout.views import same_start


@contextlib.contextmanager
def python_side_kept(params: list[nn.Parameter]) -> Iterator[None]:
    """torch converts a DTensor parameter by swapping a new Parameter's
    tensor, class and attributes into the same object (``swap_tensors``): the
    object stays, but what was set on it -- the one-call form's
    ``__fsdp_param__`` marker, a swapped class's members -- would not. During
    the conversion each parameter has the class ``swap_class`` started from
    (torch's ``Parameter()`` refuses a class whose ``detach()`` answers
    another); after it, its class and attributes come back."""
    kept = [(p, dict(vars(p)), unswap(p)) for p in params]
    try:
        yield
    finally:
        for param, attributes, cls in kept:
            reswap(param, cls)
            for name, value in attributes.items():
                vars(param).setdefault(name, value)


def convert_sharded(state, module: nn.Module, apply: Callable[[], nn.Module]) -> nn.Module:
    """Run ``module``'s own ``_apply`` (``apply``) on its sharded parameters:
    the unit resharded first, what torch's swap would drop kept, and the
    converted values taken into the unit's groups after."""
    state.reshard()
    with python_side_kept([p for g in state.groups for p in g.sharded_params]):
        ret = apply()
    adopt_converted(state, module)
    return ret


def adopt_converted(state, module: nn.Module) -> None:
    """Take the values torch's conversion left at ``module``'s parameter
    locations into ``state``'s groups."""
    state.groups = [_adopt(group, state, module) for group in state.groups]
    for group in state.groups:
        group.use_sharded_params()
    state.deferred.note_baseline(state.groups)  # what conversion wrote is not the user's initialisation


def _adopt(group: ParamGroup, state, module: nn.Module) -> ParamGroup:
    if not isinstance(group, ParamGroup):
        _check_subclass_unconverted(group, module)
        return group
    inside = {id(m) for m in module.modules()}
    converted = []
    for slot, sharded in zip(group.slots, group.sharded_params):
        here = [(m, a) for m, a in slot.locations if id(m) in inside]
        value = here[0][0]._parameters[here[0][1]] if here else sharded
        converted.append(value)
    locals_ = [v.to_local() if isinstance(v, DTensor) else v for v in converted]
    unchanged = all(v is s for v, s in zip(converted, group.sharded_params))
    if unchanged and all(same_start(t, group.main_chunk(i)) for i, t in enumerate(locals_)
                         if t.numel()):
        return group  # nothing converted (e.g. .to() to what it already was)
    dtype, device = locals_[0].dtype, locals_[0].device
    main = group.tensors().main_weights
    if dtype == main.dtype and device == main.device:
        target = group
    else:
        target = _rebuilt(group, state, dtype, device)
    with torch.no_grad():
        for index, local in enumerate(locals_):
            chunk = target.main_chunk(index)
            if local.shape != chunk.shape:
                raise RuntimeError(f"converting '{target.slots[index].fqn}' changed its shard shape "
                                   f"{tuple(chunk.shape)} -> {tuple(local.shape)}")
            if not same_start(local, chunk):
                chunk.copy_(local)
    if target is group:
        # torch may have re-pointed the parameter objects themselves at the
        # converted copies (``param.data = ...``): make them view the buffers again.
        group.refresh_views()
    target.note_weights_written()
    return target


def _check_subclass_unconverted(group, module: nn.Module) -> None:
    """A group of subclass parameters (subclass_group) holds the subclass's own
    local tensors: a conversion that changed one's dtype or device, or put
    another tensor in its place, is refused by name rather than half-applied."""
    inside = {id(m) for m in module.modules()}
    for slot, sharded in zip(group.slots, group.sharded_params):
        values = [m._parameters.get(attr) for m, attr in slot.locations if id(m) in inside] or [sharded]
        local = sharded._local_tensor
        if any(v is not sharded for v in values) or local.dtype != slot.param.dtype or \
                local.device.type != group.compute_device.type:
            raise NotImplementedError(
                f"converting parameter '{slot.fqn}' ({type(local).__name__}) after fully_shard is not supported: "
                "convert the model before sharding it")


def _rebuilt(group: ParamGroup, state, dtype: torch.dtype, device: torch.device) -> ParamGroup:
    """A group like ``group`` whose weights have a new dtype / device: new
    original parameters (full size, filled from the chunks afterwards)."""
    slots = []
    for slot in group.slots:
        param = nn.Parameter(torch.empty(slot.param.shape, dtype=dtype if slot.param.is_floating_point()
                                         else slot.param.dtype, device=device),
                             requires_grad=slot.param.requires_grad)
        for m, attr in slot.locations:
            m._parameters[attr] = param
        slots.append(dataclasses.replace(slot, param=param))
    return ParamGroup(slots, placement=group.placement, policy=state.options.policy, device=device,
                      transport=state.options.switches.transport, fill=False, home=group.home)
