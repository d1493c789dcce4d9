"""The two spellings of a sharded model's state-dict keys, and the check that
keeps a wrong state dict from being half-loaded.

Stock Megatron-FSDP's ``MegatronFSDP`` wraps the user's model, so its keys are
``module.``-prefixed (``module.emb.weight``); so are this package's
``MegatronFSDP``'s, so that a checkpoint moves between the two with the same
user code. flatfsdp's one-call ``flatfsdp.fully_shard`` returns the user's
model itself, unprefixed (``emb.weight``): its checkpoints keep loading there,
and this wrapper's ``load_state_dict`` takes that spelling too.

torch's ``load_state_dict`` copies every value it can and only then reports
missing, unexpected or mis-shaped keys: a state dict of another model would be
half-loaded. The whole dict is checked here first, and refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

PREFIX = "module."


def checked_module_state_dict(wrapper: nn.Module, state_dict: dict[str, Any], strict: bool) -> dict[str, Any]:
    """``state_dict`` in the wrapper's spelling, once it is known to fit: the
    keys (when ``strict``) and every shape of a key both sides hold."""
    expected = wrapper.state_dict()
    given = dict(state_dict)
    if given and not any(k.startswith(PREFIX) for k in given) and any(k.startswith(PREFIX) for k in expected):
        given = {PREFIX + k: v for k, v in given.items()}  # flatfsdp.fully_shard's spelling
    what = type(wrapper.module).__name__
    if strict:
        missing = sorted(set(expected) - set(given))
        unexpected = sorted(set(given) - set(expected))
        if missing or unexpected:
            raise RuntimeError(f"state dict does not fit {what} (nothing was loaded): missing keys "
                               f"{_few(missing)}, unexpected keys {_few(unexpected)}")
    for key in sorted(set(given) & set(expected)):
        value, own = given[key], expected[key]
        if isinstance(value, torch.Tensor) and isinstance(own, torch.Tensor) and value.shape != own.shape:
            raise RuntimeError(f"state dict does not fit {what} (nothing was loaded): {key!r} has shape "
                               f"{tuple(value.shape)} there and {tuple(own.shape)} in the model")
    return given


def _few(keys: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return f"[{shown}{', ...' if len(keys) > limit else ''}] ({len(keys)})"
