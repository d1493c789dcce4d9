"""What a sharded model keeps on this rank between steps."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from flatfsdp.engine.runtime.unit_state import unit_states


def persistent_buffer_bytes(model: nn.Module) -> int:
    """Bytes held by the engine's persistent buffers (model weights, main weights,
    gradients) on this rank, over every sharded unit in ``model``. Transient
    buffers (gathered weights of ZeRO-3, unsharded gradients of ZeRO-2/3) are
    excluded: they live only between a gather and its release."""
    return sum(group.memory().persistent_bytes() for state in unit_states(model) for group in state.groups)


def persistent_bytes_by_role(model: nn.Module) -> dict[str, int]:
    """``persistent_buffer_bytes`` by role: "main weights", "model weights" (a
    separate compute-dtype copy) and "gradients"."""
    total: Counter = Counter({"main weights": 0, "model weights": 0, "gradients": 0})
    for state in unit_states(model):
        for group in state.groups:
            total.update(group.memory().persistent_bytes_by_role())
    return dict(total)


def allocated_buffer_bytes(model: nn.Module) -> int:
    """Bytes the engine's buffers hold right now, transient ones included.
    Between steps it equals ``persistent_buffer_bytes``: anything more is a leak."""
    return sum(group.memory().allocated_bytes() for state in unit_states(model) for group in state.groups)


def resizable_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The engine's flat tensors whose storage is freed and re-allocated in
    place (no op announces it): what a memory meter re-reads to see transient
    buffers come and go."""
    return [t for state in unit_states(model) for group in state.groups for t in group.memory().flat_buffers()]


def held_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor the engine holds for ``model`` between steps, including
    those no parameter views (a separate compute-dtype copy of the chunks, for
    one): what a memory meter must count as alive when a step begins."""
    return [t for state in unit_states(model) for group in state.groups for t in group.memory().held_tensors()]
