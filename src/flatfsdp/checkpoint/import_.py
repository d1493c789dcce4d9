"""Turning a plain state-dict file (`.safetensors` or `.pt`) into a checkpoint that
a sharded model can load: keys get the ``model.`` prefix so that the result
matches ``{"model": model.state_dict()}``, and DCP reshards the full tensors
into whatever placements the loading model uses.
"""

from __future__ import annotations

import os
import pickle

import torch

from flatfsdp.checkpoint.errors import CheckpointError, weights_only_reason
from flatfsdp.checkpoint.safetensors_format import read_safetensors
from flatfsdp.checkpoint.save_load import save


def _flatten(tree, path: str, source: str, out: dict) -> dict:
    for key, value in tree.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{source}: not a plain state dict (key {key!r} is not a string)")
        name = f"{path}{key}"
        if isinstance(value, dict):
            _flatten(value, name + ".", source, out)
        elif isinstance(value, torch.Tensor):
            out[name] = value
        else:
            raise CheckpointError(f"{source}: not a plain state dict ({name!r} holds a {type(value).__name__})")
    return out


def _read_pt(source: str):
    try:
        # mmap keeps tensors on disk until DCP writes them; only the newer zip
        # format supports it, so fall back to a plain read for legacy files.
        try:
            return torch.load(source, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{source}: refusing to unpickle a file that is not a plain state dict "
                              f"({weights_only_reason(exc)})") from None
    except (RuntimeError, EOFError) as exc:
        raise CheckpointError(f"{source}: truncated or corrupted ({str(exc).splitlines()[0]})") from None


def read_state_dict(source) -> dict[str, torch.Tensor]:
    """A flat ``{name: tensor}`` from a `.safetensors` or `.pt` file (weights_only; nested dicts joined by '.')."""
    source = os.fspath(source)
    if not os.path.isfile(source):
        raise CheckpointError(f"{source}: no such file")
    kind = os.path.splitext(source)[1]
    if kind == ".safetensors":
        loaded = read_safetensors(source)
    elif kind in (".pt", ".pth", ".bin"):
        loaded = _read_pt(source)
    else:
        raise CheckpointError(f"{source}: expected a .safetensors or .pt file")
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{source}: not a state dict (holds a {type(loaded).__name__})")
    return _flatten(loaded, "", source, {})


def import_state_dict(source, directory, *, prefix: str = "model.") -> int:
    """Save the state dict in ``source`` as a checkpoint at ``directory``; returns the
    tensor count. Runs in this process alone, also inside a distributed job."""
    tensors = read_state_dict(source)
    save({f"{prefix}{name}": tensor for name, tensor in tensors.items()}, directory, no_dist=True)
    return len(tensors)
