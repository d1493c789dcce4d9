"""The tensors inside the values modules take and return.

A unit must see every tensor of its inputs and outputs: a gradient that
reaches an output the hooks missed would run the unit's backward with its
weights released (or still in flight), silently. Modules pass tensors in
tuples, lists, dicts, namedtuples and dataclasses -- all handled here, as FSDP2
handles them; anything else is opaque.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Iterator

import torch


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with every tensor ``t`` in it replaced by ``fn(t)``; containers
    are copied (never changed in place), their types kept."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = copy.copy(value)
        for field in dataclasses.fields(value):
            object.__setattr__(out, field.name, map_tensors(fn, getattr(value, field.name)))
        return out
    if isinstance(value, tuple):
        items = [map_tensors(fn, v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        out = copy.copy(value)
        out[:] = [map_tensors(fn, v) for v in value]
        return out
    if isinstance(value, dict):
        out = copy.copy(value)
        for key, v in value.items():
            out[key] = map_tensors(fn, v)
        return out
    return value


def tensors_in(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(lambda t: found.append(t) or t, value)
    return found


def replace_tensors(value: Any, replacements: Iterator[torch.Tensor], which: Callable[[torch.Tensor], bool]) -> Any:
    """``value`` with each tensor for which ``which`` holds replaced by the next
    of ``replacements`` (in ``tensors_in`` order)."""
    return map_tensors(lambda t: next(replacements) if which(t) else t, value)
