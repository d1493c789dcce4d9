"""The one-call form's unit modules that share a parameter with each other
(a tied token table and output head): one unit, not two.

A parameter must belong to one unit holding every module that uses it
(runtime/tied_params.py). Unit modules tied only to each other become one
unit of several modules (FSDP2's ``fully_shard([embedding, head])``):
gathered when the first of them runs, released when the last is done. Where
a module outside every unit module also uses the parameter, the root keeps
it, as before.
"""

from __future__ import annotations

from torch import nn

from flatfsdp.engine.runtime.tied_params import params_used_outside


def tied_unit_groups(model: nn.Module, inner: list[nn.Module]) -> list[list[nn.Module]]:
    """``inner`` (the unit modules below the root, in any order) partitioned:
    modules tied only to each other share a list, in ``inner``'s order; every
    other module is a list of one."""
    leader = {id(m): i for i, m in enumerate(inner)}

    def find(i: int) -> int:
        while leader[id(inner[i])] != i:
            i = leader[id(inner[i])]
        return i

    unit_of = _innermost_unit_of_each_module(model, inner)
    holders = _holders(model)
    for module in inner:
        for pid in params_used_outside(module, model):
            owners = {unit_of.get(id(h)) for h in holders[pid]}
            if None in owners or any(_nested(a, b) for a in owners for b in owners if a is not b):
                continue  # used outside every unit module, or by nested ones: the root keeps it
            first, *rest = sorted(find(inner.index(o)) for o in owners)
            for other in rest:
                leader[id(inner[other])] = first
    groups: dict[int, list[nn.Module]] = {}
    for i, module in enumerate(inner):
        groups.setdefault(find(i), []).append(module)
    return list(groups.values())


def _innermost_unit_of_each_module(model: nn.Module, inner: list[nn.Module]) -> dict[int, nn.Module]:
    unit_of: dict[int, nn.Module] = {}
    for unit in sorted(inner, key=lambda m: -sum(1 for _ in m.modules())):  # outer first, inner overwrite
        for m in unit.modules():
            unit_of[id(m)] = unit
    return unit_of


def _holders(model: nn.Module) -> dict[int, list[nn.Module]]:
    found: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                found.setdefault(id(param), []).append(module)
    return found


def _nested(a: nn.Module, b: nn.Module) -> bool:
    return any(m is b for m in a.modules())


def used_outside(group: list[nn.Module], model: nn.Module) -> frozenset[int]:
    """ids of the group's parameters that a module outside all of it also registers (an outer unit owns them)."""
    inside = {id(m) for unit in group for m in unit.modules()}
    outside: set[int] = set()
    for module in model.modules():
        if id(module) not in inside:
            outside.update(id(p) for p in module._parameters.values() if p is not None)
    return frozenset(id(p) for unit in group for p in unit.parameters() if id(p) in outside)
