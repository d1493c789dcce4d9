"""Megatron-FSDP's keywords on a bound optimizer's ``step`` and ``zero_grad``.

``megatron_fsdp.fully_shard_optimizer`` replaces the optimizer's ``step`` and
``zero_grad`` with closures set on the instance; flatfsdp sets nothing on it
(tests/test_no_global_state.py). ``step``'s keywords go through the
optimizer's own step pre-hook, which may rewrite the call's arguments
(optimizer.py installs it); ``zero_grad`` has no hook, so the optimizer's
class becomes a subclass of its own -- same name, every method its own but
``zero_grad`` -- as a sharded module's class does (FSDP2's class swap).
"""

from __future__ import annotations

from typing import Any

import torch

from flatfsdp.engine.front.megatron_model import megatron_views_of
from flatfsdp.engine.runtime.class_swap import swap_class


class MegatronOptimizerMixin:
    """``zero_grad(..., zero_grad_buffer=True)``: as the optimizer's own, then
    (by default) the models' ``zero_grad_buffer()`` -- every gradient of the
    step forgotten, those still accumulating or in flight included -- for the
    param groups this optimizer steps whole (with one optimizer: the model)."""

    def zero_grad(self, *args: Any, zero_grad_buffer: bool = True, **kwargs: Any) -> None:
        super().zero_grad(*args, **kwargs)
        if zero_grad_buffer:
            # set_to_none=False keeps the .grad tensors (zeroed), as the optimizer's own zero_grad
            # does; Megatron-FSDP drops them anyway, flatfsdp keeps what the caller asked for.
            set_to_none = args[0] if args else kwargs.get("set_to_none", True)
            params = self._all_params()
            for view in megatron_views_of(params):
                view.zero_grad_buffer(keep_grads=not set_to_none, params=params)

    def _all_params(self):
        return [p for group in self.param_groups for p in group["params"]]


def take_megatron_keywords(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.zero_grad`` take ``zero_grad_buffer=`` (its class swapped once)."""
    swap_class(optimizer, MegatronOptimizerMixin)


def before_megatron_step(optimizer: torch.optim.Optimizer, kwargs: dict) -> dict:
    """Strip Megatron-FSDP's step keywords from the call and return the rest.
    ``sync_grad_before_optimizer_step`` (default True): without auto-sync,
    finish the models' gradient synchronisation first, as Megatron-FSDP's step
    does (False skips only that: reductions in flight are waited for anyway,
    the optimizer must not read half-reduced gradients).
    ``install_optimized_model_weights`` changes nothing: flatfsdp derives the
    model weights from the main weights before their next use whenever these
    changed, so there is no copy to defer (docs/megatron.md)."""
    kwargs = dict(kwargs)
    sync = kwargs.pop("sync_grad_before_optimizer_step", True)
    kwargs.pop("install_optimized_model_weights", None)
    for view in megatron_views_of(p for g in optimizer.param_groups for p in g["params"]):
        if sync and not view.model_auto_sync:
            view.finish_grad_sync()
    return kwargs
