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

from flatfsdp.engine.runtime.tied_params import holders


def tied_unit_groups(model: nn.Module, inner: list[nn.Module]) -> list[list[nn.Module]]:
    """``inner`` (the unit modules below the root, in any order) partitioned:
    modules tied only to each other share a list, in ``inner``'s order; every
    other module is a list of one."""
    leader = list(range(len(inner)))

    def find(i: int) -> int:
        while leader[i] != i:
            i = leader[i]
        return i

    unit_of = _innermost_unit_of_each_module(inner)
    position = {id(m): i for i, m in enumerate(inner)}
    for users in holders(model).values():
        owners = {unit_of.get(id(h)) for h in users}
        if len(owners) < 2 or None in owners or any(_nested(a, b) for a in owners for b in owners if a is not b):
            continue  # one unit's own, used outside every unit module, or by nested ones (the outer keeps it)
        first, *rest = sorted(find(position[id(o)]) for o in owners)
        for other in rest:
            leader[other] = first
    groups: dict[int, list[nn.Module]] = {}
    for i, module in enumerate(inner):
        groups.setdefault(find(i), []).append(module)
    return list(groups.values())


def _innermost_unit_of_each_module(inner: list[nn.Module]) -> dict[int, nn.Module]:
    unit_of: dict[int, nn.Module] = {}
    for unit in sorted(inner, key=lambda m: -sum(1 for _ in m.modules())):  # outer first, inner overwrite
        for m in unit.modules():
            unit_of[id(m)] = unit
    return unit_of


def _nested(a: nn.Module, b: nn.Module) -> bool:
    return any(m is b for m in a.modules())
