"""The class a sharded module becomes: its own class plus FSDP controls, as in
PyTorch FSDP2, so ``isinstance`` checks and the module's behaviour survive."""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

from flatfsdp.engine.unit_state import UnitState

_CLASS_CACHE: dict[type, type] = {}


class FSDPModule:
    """Mixin added to every sharded unit's class. Methods act on this unit and,
    where they take ``recurse``, on the sharded units below it."""

    _flatfsdp_state: UnitState

    def unshard(self, async_op: bool = False) -> None:
        """Gather this unit's parameters now (e.g. before calling a method other than forward)."""
        self._flatfsdp_state.unshard(async_op=async_op)
        if not async_op:
            self._flatfsdp_state.wait_unshard()

    def reshard(self) -> None:
        """Release the gathered parameters; the module shows its sharded DTensors again."""
        self._flatfsdp_state.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward accumulates unsharded gradients locally and communicates
        nothing; the next backward with True reduces the sum once."""
        for state in self._states(recurse):
            state.requires_grad_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool | None, *, recurse: bool = True) -> None:
        """False keeps the unit gathered from its forward to its backward: one
        all-gather fewer per step, its full weights held meanwhile. True always
        releases. None (the default): release, except the unit that runs last
        in forward, whose backward follows at once."""
        for state in self._states(recurse):
            state.reshard_after_forward = reshard_after_forward

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation without communication inside the block."""
        states = list(self._states(True))
        previous = [s.requires_grad_sync for s in states]
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for state, value in zip(states, previous):
                state.requires_grad_sync = value

    def finish_grad_sync(self) -> None:
        """Wait for gradient reductions still in flight (needed only with
        ``sync_model_each_microbatch=False``; optimizers bound by
        ``fully_shard_optimizer`` do it before stepping)."""
        context = self._flatfsdp_state.context
        if context is not None:
            context.wait_reductions()

    def _states(self, recurse: bool) -> Iterator[UnitState]:
        if not recurse:
            yield self._flatfsdp_state
            return
        for module in self.modules():  # type: ignore[attr-defined]
            state = getattr(module, "_flatfsdp_state", None)
            if state is not None:
                yield state


def become_fsdp_module(module: nn.Module, state: UnitState) -> None:
    """Swap the instance's class for ``FSDP<Class>`` (cached per class)."""
    cls = type(module)
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
    module._flatfsdp_state = state
    module.__class__ = _CLASS_CACHE[cls]
