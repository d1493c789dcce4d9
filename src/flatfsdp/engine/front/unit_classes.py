"""Resolve ``fsdp_unit_modules`` (classes or import paths) against a model."""

from __future__ import annotations

import importlib
from typing import Iterable

from torch import nn


def resolve_unit_classes(entries: Iterable[type | str], model: nn.Module) -> tuple[type, ...]:
    classes = []
    for entry in entries:
        cls = _import_class(entry) if isinstance(entry, str) else entry
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"fsdp_unit_modules entry {entry!r} is not an nn.Module subclass")
        if not any(isinstance(m, cls) for m in model.modules()):
            raise ValueError(f"fsdp_unit_modules entry {_name(cls)}: no module of "
                             f"{type(model).__name__} is an instance of it")
        classes.append(cls)
    return tuple(classes)


def _import_class(path: str) -> type:
    module_path, _, attr = path.rpartition(".")
    if not module_path:
        raise ValueError(f"fsdp_unit_modules entry {path!r} is not an import path like 'package.module.Class'")
    try:
        module = importlib.import_module(module_path)
    except ImportError as err:
        raise ValueError(f"fsdp_unit_modules entry {path!r} does not resolve: cannot import "
                         f"{module_path!r} ({err})") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"fsdp_unit_modules entry {path!r} does not resolve: module {module_path!r} "
                         f"has no attribute {attr!r}") from None


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
