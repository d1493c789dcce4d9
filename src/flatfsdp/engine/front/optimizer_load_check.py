"""Optimizer state that does not fit a bound optimizer is refused, by name,
before anything is loaded.

torch's ``Optimizer.load_state_dict`` pairs the state dict's parameters with
its own by position -- group by group, in the optimizer's order, whether the
state dict numbers them (``optimizer.state_dict()``) or names them (what
``set_optimizer_state_dict`` hands it) -- and checks only that the groups have
the same sizes. A state of another model, or one numbered in another
parameter order, then lands on whichever parameter holds that place: an
error at the first step where the shapes differ, silently wrong moments where
they agree. flatfsdp numbers state as torch does (the optimizer's own order,
which is what ``get_optimizer_state_dict`` reads it by) and checks, in a
load pre-hook, everything the pairing rests on:

* the same number of param groups, each of the same size;
* where the state names its parameters, the name at each place is the name
  of the parameter that holds it here;
* every value shaped like a parameter has this parameter's global shape (a
  state the optimizer holds already fixes the shape of each of its keys;
  else torch's per-element keys, ``exp_avg`` and the like, follow the
  parameter) and is a DTensor where this optimizer keeps DTensor shards;
* no parameter whose state this optimizer holds is left out (it would keep
  nothing of the checkpoint, beside parameters that took theirs).

Ranks check their own state dicts and then agree (one object all-gather over
each data-parallel group): if any rank refuses, every rank refuses, naming
the rank, so no rank loads while another keeps its state.
"""

from __future__ import annotations

import weakref
from itertools import chain
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

PER_ELEMENT_KEYS = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                              "acc_delta", "sum", "ax", "prev", "step_size", "grad_avg"})
"""Keys torch's own optimizers keep with the parameter's shape."""

WRAPPER_TOKENS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
"""Module names wrappers insert into a parameter's name (torch.compile, activation checkpointing, FSDP1)."""


class OptimizerStateMismatch(ValueError):
    """An optimizer state dict that does not fit the optimizer: what, where, on which rank."""


class LoadCheck:
    """The load pre-hook of one optimizer: the models it is bound to (held
    weakly, for the parameters' names) and the param groups it steps (whose
    data-parallel ranks must agree)."""

    def __init__(self):
        self._models: list[weakref.ref] = []
        self._groups: list = []

    def add(self, model: nn.Module, groups: list) -> None:
        if not any(ref() is model for ref in self._models):
            self._models.append(weakref.ref(model))
        self._groups += [g for g in groups if all(g is not h for h in self._groups)]

    def __call__(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        names: dict[int, str] = {}
        for ref in self._models:
            for pid, name in _parameter_names(ref()).items():
                names.setdefault(pid, name)
        mine = mismatches(optimizer, state_dict, lambda p: names.get(id(p)))
        everyone = _agree(mine, _process_groups(self._groups))
        if everyone:
            raise OptimizerStateMismatch(f"optimizer state does not fit {type(optimizer).__name__} (nothing was "
                                         "loaded): " + "; ".join(everyone))


def install_load_check(optimizer: torch.optim.Optimizer, model: nn.Module, groups: list) -> None:
    """Check every state dict ``optimizer`` loads (one hook per optimizer,
    however often it is bound)."""
    hooks = optimizer._optimizer_load_state_dict_pre_hooks.values()  # torch keeps no public list of them
    check = next((h for h in hooks if isinstance(h, LoadCheck)), None)
    if check is None:
        check = LoadCheck()
        optimizer.register_load_state_dict_pre_hook(check)
    check.add(model, groups)


def mismatches(optimizer: torch.optim.Optimizer, state_dict: dict,
               name_of: Callable[[nn.Parameter], str | None]) -> list[str]:
    """What keeps ``state_dict`` from loading into ``optimizer``, each naming
    the parameter (``name_of``: its name in the model, None where unknown)."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) \
            or not isinstance(state_dict.get("param_groups"), list):
        return ["it is not an optimizer state dict (it needs 'state' and 'param_groups')"]
    theirs = [list(g.get("params", ())) for g in state_dict["param_groups"]]
    ours = [list(g["params"]) for g in optimizer.param_groups]
    structure = _group_differences(theirs, ours, name_of)
    if structure:
        return structure
    state = state_dict["state"]
    kinds = {type(k).__name__ for k in chain(state, *theirs)}
    if len(kinds) > 1:
        return [f"it keys parameters by {' and '.join(sorted(kinds))} at once"]
    place = dict(zip(chain(*theirs), chain(*ours)))
    found = [f"it holds state under {k!r}, which none of its param groups lists" for k in state if k not in place]
    for key, param in place.items():
        name = name_of(param)
        if isinstance(key, str) and name is not None and not same_parameter_name(key, name):
            found.append(f"it names {key!r} where this optimizer holds {name!r}")
            continue
        label = name or (key if isinstance(key, str) else f"the parameter of shape {tuple(param.shape)}")
        found += _entry_differences(label, state.get(key), param, optimizer.state.get(param))
    return found


def same_parameter_name(saved: str, ours: str) -> bool:
    """The same parameter, named from the same or an enclosing module (a
    wrapper's ``module.`` prefix), wrappers' inserted names aside."""
    saved, ours = (_without_wrappers(n) for n in (saved, ours))
    return saved == ours or saved.endswith("." + ours) or ours.endswith("." + saved)


def _without_wrappers(name: str) -> str:
    for token in WRAPPER_TOKENS:
        name = name.replace(token, "")
    return name


def _group_differences(theirs: list[list], ours: list[list], name_of) -> list[str]:
    if len(theirs) != len(ours):
        return [f"it holds {len(theirs)} param group(s) of {[len(g) for g in theirs]} parameter(s), this optimizer "
                f"{len(ours)} of {[len(g) for g in ours]}"]
    return [f"its param group {gi} lists {len(t)} parameter(s), this optimizer's {len(o)}"
            + (f" (first here: {name_of(o[0])!r})" if o and name_of(o[0]) else "")
            for gi, (t, o) in enumerate(zip(theirs, ours)) if len(t) != len(o)]


def _entry_differences(name: str, entry, param: nn.Parameter, held: dict | None) -> list[str]:
    """One parameter's incoming state against the parameter and the state held for it."""
    if entry is None:
        if held and _local_numel(param) > 0:
            return [f"it has no state for {name!r}, for which this optimizer holds {sorted(held)}"]
        return []
    if not isinstance(entry, dict):
        return [f"its state for {name!r} is a {type(entry).__name__}, not a dict of values"]
    found = []
    for key, value in entry.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        now = (held or {}).get(key)
        want = tuple(now.shape) if isinstance(now, torch.Tensor) and now.dim() > 0 else \
            tuple(param.shape) if key in PER_ELEMENT_KEYS else None
        if want is not None and tuple(value.shape) != want:
            found.append(f"its {key} for {name!r} has shape {tuple(value.shape)}, the parameter's is {want}")
        elif isinstance(param, DTensor) and not isinstance(value, DTensor) and want == tuple(param.shape) \
                and value.shape != param.to_local().shape:
            found.append(f"its {key} for {name!r} is a whole tensor where this optimizer keeps each rank's "
                         "DTensor shard (load a full state with set_optimizer_state_dict(..., "
                         "options=StateDictOptions(full_state_dict=True)))")
    return found


def _local_numel(param: torch.Tensor) -> int:
    return param.to_local().numel() if isinstance(param, DTensor) else param.numel()


def _parameter_names(model: nn.Module | None) -> dict[int, str]:
    if model is None:
        return {}
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names


def _process_groups(groups: list) -> list:
    """The data-parallel process groups of the optimizer's param groups, once each."""
    found: dict[int, object] = {}
    for group in groups:
        dp = group.placement.dp
        for mesh in (dp.shard, dp.outer):
            if mesh is not None and mesh.size() > 1:
                pg = mesh.get_group()
                found.setdefault(id(pg), pg)
    return list(found.values())


def _agree(mine: list[str], process_groups: list) -> list[str]:
    """Every rank's refusals, rank-named, the same on every rank of ``process_groups``."""
    if not process_groups:
        return mine
    rank = dist.get_rank()
    said: dict[int, list[str]] = {rank: mine} if mine else {}
    for pg in process_groups:
        if dist.get_backend(pg) == "fake":
            continue
        everyone: list = [None] * dist.get_world_size(pg)
        dist.all_gather_object(everyone, (rank, mine), group=pg)
        said.update({r: p for r, p in everyone if p})
    return [f"rank {r}: " + "; ".join(p[:5]) + (f"; and {len(p) - 5} more" if len(p) > 5 else "")
            for r, p in sorted(said.items())]
