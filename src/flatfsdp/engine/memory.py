"""What a sharded model keeps on this rank between steps."""

from __future__ import annotations

from torch import nn

from flatfsdp.engine.unit_state import unit_states


def persistent_buffer_bytes(model: nn.Module) -> int:
    """Bytes held by the engine's persistent buffers (model weights, main weights,
    gradients) on this rank, over every sharded unit in ``model``. Transient
    buffers (gathered weights of ZeRO-3, unsharded gradients of ZeRO-2/3) are
    excluded: they live only between a gather and its release."""
    return sum(group.persistent_bytes() for state in unit_states(model) for group in state.groups)


def allocated_buffer_bytes(model: nn.Module) -> int:
    """Bytes the engine's buffers hold on this rank right now, transient ones
    included. Between steps it equals ``persistent_buffer_bytes``: anything
    more is a leak."""
    return sum(group.allocated_bytes() for state in unit_states(model) for group in state.groups)
