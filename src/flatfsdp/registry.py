"""Which parameters flatfsdp created, and when an optimizer last stepped them.

A sharded parameter's value can change behind the engine's back in two ways:
an optimizer step (whose foreach kernels update DTensors without bumping the
parameters' version counters) and a user's in-place edit (which does bump
them). The weights epoch counts the first; version counters catch the second.
"""

from __future__ import annotations

from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

SHARDED_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Original parameter -> the DTensor parameter the optimizer steps in its place."""
ORIGINAL_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""The reverse map."""

_weights_epoch = 0


def is_sharded_param(param) -> bool:
    return param in ORIGINAL_OF


def weights_epoch() -> int:
    return _weights_epoch


def _after_any_optimizer_step(optimizer, args, kwargs) -> None:
    global _weights_epoch
    if any(p in ORIGINAL_OF for group in optimizer.param_groups for p in group["params"]):
        _weights_epoch += 1


register_optimizer_step_post_hook(_after_any_optimizer_step)
