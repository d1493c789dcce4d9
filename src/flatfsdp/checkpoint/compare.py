"""What the caller asks to load versus what a checkpoint holds, as one readable error.

DCP on its own fails on the first missing key with an internal message, and
silently casts a dtype or fails deep inside a copy on a shape mismatch; when
someone points a model at another model's checkpoint they want the whole list.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

_SHOWN = 10


def requested_entries(state_dict: dict) -> dict:
    """The caller's state dict flattened the way DCP names entries ("model.tok_emb.weight")."""
    # Same treatment as dcp.load: a Stateful value stands for its state_dict().
    resolved = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}
    flat, _mapping = flatten_state_dict(resolved)
    return flat


def _shape(size) -> str:
    return "(" + ", ".join(str(d) for d in size) + ("," if len(size) == 1 else "") + ")"


def _mismatch(key: str, value, stored) -> str | None:
    if isinstance(stored, BytesStorageMetadata):
        return f"{key}: checkpoint holds a non-tensor value" if isinstance(value, torch.Tensor) else None
    if not isinstance(value, torch.Tensor):
        return f"{key}: checkpoint holds a tensor, a {type(value).__name__} was requested"
    assert isinstance(stored, TensorStorageMetadata)
    problems = []
    if tuple(stored.size) != tuple(value.size()):  # DTensor/ShardedTensor .size() is global
        problems.append(f"shape {_shape(stored.size)} in checkpoint vs {_shape(value.size())} requested")
    if stored.properties.dtype != value.dtype:
        problems.append(f"dtype {stored.properties.dtype} in checkpoint vs {value.dtype} requested")
    return f"{key}: " + ", ".join(problems) if problems else None


def _listing(title: str, items: list[str]) -> str:
    shown = items[:_SHOWN] + ([f"... and {len(items) - _SHOWN} more"] if len(items) > _SHOWN else [])
    return f"\n  {len(items)} {title}:" + "".join(f"\n    {line}" for line in shown)


def mismatch_report(state_dict: dict, metadata: Metadata, *, strict: bool) -> str | None:
    """None when ``state_dict`` can load from ``metadata``; else a multi-line description.

    Unexpected keys are those in the checkpoint under a top-level key the caller
    asked for ("model.*" when loading ``{"model": ...}``) that the caller lacks:
    loading only the model from a model+optimizer checkpoint is not an error.
    With ``strict=False`` missing and unexpected keys are allowed (missing ones
    keep their current values); shape and dtype mismatches never are.
    """
    requested = requested_entries(state_dict)
    stored = metadata.state_dict_metadata
    roots = tuple(str(k) for k in state_dict)
    missing = sorted(k for k in requested if k not in stored)
    unexpected = sorted(k for k in stored if k not in requested
                        and any(k == r or k.startswith(r + ".") for r in roots))
    mismatched = sorted(m for k in requested if k in stored
                        if (m := _mismatch(k, requested[k], stored[k])) is not None)
    if not strict:
        missing, unexpected = [], []
    if not (missing or unexpected or mismatched):
        return None
    parts = []
    if missing:
        parts.append(_listing("missing keys (requested, not in the checkpoint)", missing))
    if unexpected:
        parts.append(_listing("unexpected keys (in the checkpoint, not requested)", unexpected))
    if mismatched:
        parts.append(_listing("mismatched entries", mismatched))
    return "".join(parts)
