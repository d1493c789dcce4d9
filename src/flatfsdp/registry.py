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
GROUP_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Sharded parameter -> (its ParamGroup, its index there)."""
FQN_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Sharded parameter -> its name in the unsharded model (from the outermost sharded module)."""

_weights_epoch = 0


def is_sharded_param(param) -> bool:
    return param in ORIGINAL_OF


def weights_epoch() -> int:
    return _weights_epoch


def mark_weights_changed() -> None:
    """The main weights were written outside an optimizer step (e.g. a load):
    model weights are re-cast and re-gathered before next use."""
    global _weights_epoch
    _weights_epoch += 1


def _after_any_optimizer_step(optimizer, args, kwargs) -> None:
    if any(p in ORIGINAL_OF for group in optimizer.param_groups for p in group["params"]):
        mark_weights_changed()
        if not getattr(optimizer, "_flatfsdp_bound", False):
            # An optimizer built on the sharded parameters (FSDP2 style):
            # give it name-keyed, reshardable state dicts too.
            from flatfsdp.optimizer import install_hooks
            install_hooks(optimizer)


register_optimizer_step_post_hook(_after_any_optimizer_step)
