"""What torch's own code reads of FSDP2's per-module state, answered by this
engine's units.

torch's helpers reach past ``FSDPModule``'s public methods into FSDP2's
private state in two ways, which differ by version (read from torch's source;
see docs/torch_versions.md):

* ``module._get_fsdp_state()`` -- ``register_fsdp_forward_method`` (all
  versions) and, on 2.15, the pipeline schedules' ``_comm_ctx`` check for
  ``defer_reduce_grad_wait``.
* ``fully_shard.state(module)`` -- the pipeline stage's ``perform_reduce_grad``
  on 2.11-2.14: for each state of ``_state_ctx.all_states`` it calls
  ``post_backward()`` on ``_fsdp_param_group`` (2.11) or each of
  ``_fsdp_param_groups`` (2.12-2.14), then ``_root_post_backward_final_callback()``.
  ``fully_shard.state`` reads the module's ``__dict__`` under the key of
  torch's ``contract`` decorator, so the view is filed there (the module's
  own dict, as ``fully_shard`` itself does; no torch object is touched).
  2.15's stage calls ``finalize_backward`` instead, a public method.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from flatfsdp.engine.runtime.unit_state import UnitState, unit_states


class Fsdp2StateView:
    """One unit, as FSDP2's ``FSDPState`` for the members torch's helpers use."""

    def __init__(self, state: UnitState):
        self._state = state

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return self._state.pre_forward(module, args, kwargs)

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return self._state.post_forward(module, args, {}, output)

    def _lazy_init(self) -> None:
        """Find the root and set up its schedule now rather than at the first forward."""
        self._state.lazy_init()

    @property
    def _modules_to_run_forward(self) -> set[nn.Module]:
        """A grouped unit's modules that have not run forward yet in this
        root forward; empty for a single-module unit, as in FSDP2."""
        return self._state.modules_yet_to_forward()

    @property
    def _is_root(self) -> bool | None:
        """FSDP2's tri-state: None before the first forward found the root."""
        return None if self._state.context is None else self._state.is_root

    @property
    def _fsdp_param_groups(self) -> list["_UnitFlush"]:
        """One entry per unit (not per dtype group): a flush reduces the whole unit."""
        return [_UnitFlush(self._state)]

    @property
    def _fsdp_param_group(self) -> "_UnitFlush":
        return _UnitFlush(self._state)

    @property
    def _state_ctx(self) -> "_RootView":
        return _RootView(self._state)

    @property
    def _comm_ctx(self) -> object:
        """An object shared by exactly the units that share reductions: their root context."""
        return self._state.context if self._state.context is not None else self._state

    def _root_post_backward_final_callback(self) -> None:
        """End the backward iteration (2.11-2.14's pipeline stage, after flushing every unit)."""
        context = self._state.context
        if context is not None:
            context.finalize_backward()
            context.end_backward_iteration()


class _RootView:
    def __init__(self, state: UnitState):
        self._state = state

    @property
    def all_states(self) -> list[Fsdp2StateView]:
        context = self._state.context
        states = context.states if context is not None else unit_states(*self._state.modules)
        return [Fsdp2StateView(s) for s in states]


class _UnitFlush:
    """FSDP2's param group as far as ``post_backward()``: reduce what the unit accumulated."""

    def __init__(self, state: UnitState):
        self._state = state

    @property
    def is_unsharded(self) -> bool:
        """Whether the unit's modules compute with gathered weights right now."""
        return self._state.is_gathered

    def post_backward(self) -> None:
        state = self._state
        if state.context is None:
            return  # never ran: nothing accumulated
        state.reduce_accumulated()
        if state.controls.reshard_after_backward:
            state.reshard()


def file_torch_state(module: nn.Module, state: UnitState) -> None:
    """Make ``torch.distributed.fsdp.fully_shard.state(module)`` answer with
    this unit's view (what 2.11-2.14's pipeline stage reads). Where torch's
    ``contract`` layout is not the one described above, nothing is filed: the
    versions that read it all have that layout (tests/test_pipelining.py runs them)."""
    try:
        from torch.distributed._composable.contract import STATE_KEY
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
    except ImportError:
        return
    key_fn = getattr(torch_fully_shard, "__wrapped__", None)  # contract keys states by the undecorated function
    if key_fn is None:
        return
    module.__dict__.setdefault(STATE_KEY, {})[key_fn] = Fsdp2StateView(state)
