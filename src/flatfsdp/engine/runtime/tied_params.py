"""Parameters shared between modules (tied embeddings): a parameter must belong
to a unit whose subtree holds every module that uses it, or it would be
released while another unit still computes with it."""

from __future__ import annotations

from torch import nn


def holders(root: nn.Module) -> dict[int, list[nn.Module]]:
    """id(parameter) -> every module under ``root`` that registers it."""
    found: dict[int, list[nn.Module]] = {}
    for module in root.modules():
        for param in module._parameters.values():
            if param is not None:
                found.setdefault(id(param), []).append(module)
    return found


def params_used_outside(unit: nn.Module | list[nn.Module], root: nn.Module) -> frozenset[int]:
    """ids of parameters inside ``unit`` (a module, or several sharded as one)
    that a module outside all of it also registers."""
    units = unit if isinstance(unit, list) else [unit]
    inside = {id(m) for u in units for m in u.modules()}
    outside_ids: set[int] = set()
    for module in root.modules():
        if id(module) in inside:
            continue
        outside_ids.update(id(p) for p in module._parameters.values() if p is not None)
    return frozenset(id(p) for u in units for p in u.parameters() if id(p) in outside_ids)


def check_params_stay_in_units(root: nn.Module) -> None:
    """Raise if a parameter is managed by two sharded units, or if a sharded
    unit's parameter is registered by a module outside that unit."""
    owner: dict[int, object] = {}
    original_owner: dict[int, str] = {}
    states = {}
    for module in root.modules():
        state = getattr(module, "_flatfsdp_state", None)
        if state is not None:
            states.setdefault(id(state), state)
    for state in states.values():
        for group in state.groups:
            for slot, param in zip(group.slots, group.sharded_params):
                owner[id(param)] = state
                first = original_owner.setdefault(id(slot.param), state.path)
                if first != state.path:
                    raise already_managed(f"{state.path + '.' if state.path else ''}{slot.fqn}", first)
    if not owner:
        return
    for holder_name, holder in root.named_modules(remove_duplicate=False):
        for attr, param in holder._parameters.items():
            if param is None or id(param) not in owner:
                continue
            state = owner[id(param)]
            if not any(m is holder for unit in state.modules for m in unit.modules()):
                raise ValueError(
                    f"parameter '{holder_name + '.' if holder_name else ''}{attr}' belongs to sharded unit "
                    f"'{state.path or '<root>'}' but module '{holder_name}' outside that unit also uses it "
                    "(tied weights?). Shard a module that contains both users, or let the root own it "
                    "(the one-call fully_shard(model, ..., fsdp_unit_modules=...) does this for you).")


def already_managed(fqn: str, owner: str) -> ValueError:
    return ValueError(
        f"parameter '{fqn}' is already managed by another sharded unit ('{owner or '<root>'}'): a parameter "
        "shared by modules sharded separately (tied weights?) must belong to one unit that contains every "
        "user of it. Shard a common parent instead, or let the root own it (the one-call "
        "fully_shard(model, ..., fsdp_unit_modules=...) does this for you).")
