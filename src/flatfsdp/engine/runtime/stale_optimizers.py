"""An optimizer that holds the parameters ``fully_shard`` replaced trains nothing.

Sharding replaces each parameter registered on the module by a DTensor over
the flat buffers; the original ``nn.Parameter`` objects only lend their
storage to the forward and never get a ``.grad`` that an optimizer could see.
An optimizer built on them before sharding and never bound
(``fully_shard(model, optimizer)`` or ``fully_shard_optimizer``) steps
nothing, without a word, every step -- the loss stays flat.

Nothing in its steps is observable from the engine (it skips parameters
without gradients; torch has no per-parameter hook to catch that, and a
process-wide optimizer hook is process-wide state). Its *cause* is: at the
root's first forward, once, every live ``torch.optim.Optimizer`` is looked
at (``gc.get_objects``, read only: tens of milliseconds) and one that holds
a replaced trainable parameter is an error, before any step is lost. An
optimizer that is garbage but not yet collected does not count: suspects are
confirmed after a ``gc.collect()``.
"""

from __future__ import annotations

import gc
import torch


def _replaced_parameters(states: list) -> dict[int, str]:
    """id(original or meta parameter) -> its name, quoted, for every trainable one
    sharding replaced (and every plain one the user assigned after sharding)."""
    names: dict[int, str] = {}
    for state in states:
        meta_of = state.deferred.meta_of()
        for group in state.groups:
            if not group.trainable:
                continue
            for slot, original in zip(group.slots, group.originals()):
                name = f"'{state.path}.{slot.fqn}'" if state.path else f"'{slot.fqn}'"
                names[id(original)] = name
                if id(original) in meta_of:
                    names[id(meta_of[id(original)])] = name
        names.update({key: f"'{name}' (a plain tensor assigned after fully_shard: its value was taken into the "
                           "sharded parameter; assign a DTensor placed like it to keep your object, or build the "
                           "optimizer after the first forward)"
                      for key, (_, name) in state.deferred.orphaned.items()})
    return names


def _holder(replaced: dict[int, str]) -> tuple[str, int, str] | None:
    for obj in gc.get_objects():
        # type(), not isinstance: isinstance reads __class__, which some module
        # objects turn into a deprecation warning.
        if issubclass(type(obj), torch.optim.Optimizer):
            held = [replaced[id(p)] for g in obj.param_groups for p in g["params"] if id(p) in replaced]
            if held:
                return type(obj).__name__, len(held), held[0]
    return None


def check_no_stale_optimizer(states: list) -> None:
    """Raise if a live optimizer holds parameters that sharding replaced.
    ``states``: the units' runtime states (``unit_state.UnitState``, which calls this)."""
    replaced = _replaced_parameters(states)
    if not replaced or _holder(replaced) is None:
        return
    gc.collect()  # an optimizer dropped inside a reference cycle is not the user's
    found = _holder(replaced)
    if found is None:
        return
    kind, count, first = found
    raise ValueError(
        f"optimizer {kind} holds {count} of the parameters that fully_shard replaced (first: {first}); it "
        "would step nothing, every step. Build the optimizer after sharding, on model.parameters(), or bind "
        "it before the first forward: fully_shard(model, optimizer, ...) or fully_shard_optimizer(optimizer, model)")
