"""A step whose layers a caller drives by hand: Megatron-Core's
expert-parallel all-to-all overlap schedule.

``pipeline_parallel/combined_1f1b.py`` (``overlap_moe_expert_parallel_comm``)
never calls a transformer layer's forward: it calls the layer's sub-modules
itself, one micro-batch's forward interleaved with another's backward, and
tells Megatron-FSDP where the step begins (``_replace_param_with_raw_if_needed``),
where each backward begins and ends (``pre_backward`` / ``post_backward``)
and where a layer's weights may go. flatfsdp gathers, releases and reduces a
unit around the unit's own forward and backward -- hooks that never fire here.
So, for such a step:

* ``begin``: every unit is gathered and shows its unsharded parameters, and
  they stay so until the step's gradients are synchronised. A layer's
  forward and backward run apart, between other micro-batches', with no hook
  to gather it again in between: the whole model's weights are held for the
  step (an unsharded model's memory; values exact), where stock gathers and
  releases layer by layer;
* ``end_backward``: what autograd left in each unit's parameters is taken
  and reduced as the end of a backward takes it (under the model's
  gradient-sync setting), nothing released;
* ``finish``: every unit is released -- the next use gathers the weights the
  optimizer steps (finish_grad_sync calls it before the step).
"""

from __future__ import annotations

from torch import nn

from flatfsdp.engine.runtime.gather_units import gather_units
from flatfsdp.engine.runtime.unit_state import unit_states


def begin(model: nn.Module) -> None:
    """Gather every unit of ``model`` and keep it gathered."""
    states = unit_states(model)
    if not states:
        raise TypeError(f"{type(model).__name__} has no sharded unit: shard it first")
    root = next((s for s in states if s.is_root), states[0])
    root.lazy_init()
    gather_units(states, async_op=False)
    for state in states:
        state.wait_unshard()


def end_backward(model: nn.Module) -> None:
    """A backward no unit hook saw has ended: its gradients are taken and reduced."""
    states = unit_states(model)
    context = states[0].context if states else None
    if context is None:
        raise RuntimeError("post_backward: no step driven by hand has begun (_replace_param_with_raw_if_needed)")
    context.finish_backward(release=False)


def finish(model: nn.Module) -> None:
    """Release every unit (a no-op where none is gathered)."""
    for state in unit_states(model):
        state.reshard()
