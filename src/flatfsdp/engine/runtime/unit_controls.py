"""What a user may change about a unit at run time (FSDP2's ``set_*`` methods):
plain values the runtime reads, so each setter is one assignment."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn


@dataclass
class UnitControls:
    reshard_after_forward: bool | None = None
    """Release the weights after the unit's forward: True, False, or None (all
    but the root and the unit that ran last in the previous step)."""
    reshard_after_backward: bool = True
    """False: keep the weights gathered after the unit's backward (gradient
    accumulation trades memory for one all-gather per microbatch)."""
    unshard_in_backward: bool = True
    """False: the backward does not need the weights (e.g. an embedding whose
    gradient needs only its input), so it is not gathered for it."""
    lookup_rows_only: bool = False
    """An embedding unit's forward gathers only the rows its input ids touch
    on any rank (comm/lookup_rows.py), and releases them after; never
    prefetched. Its gradient reduction sends those rows only. In a unit that
    also holds a module reading the whole table (a tied output head), the
    whole table is gathered once the lookup is done, while the modules
    between compute, and that module's gradient is reduced on its own,
    dense, as soon as its backward makes it; the lookup's rows come last."""
    forward_prefetch: list | None = None
    """Units to start gathering when this one runs forward (None: the next in
    the recorded order)."""
    backward_prefetch: list | None = None
    """Units to start gathering when this one's backward starts (None: the
    previous in the recorded forward order)."""
    gradient_divide_factor: float | None = None
    """Divide the summed gradients by this instead of the data-parallel size."""
    all_reduce_hook: Callable[[Any], None] | None = None
    """Called on this rank's reduced gradient shard (flat) once it lands."""
    reduce_scatter_unused_params: bool = False
    """Parameters without a gradient on this rank are reduced as zeros, so all
    ranks deliver a gradient for every parameter of the unit (ranks that use
    different parameters must set it, or their optimizers step different sets)."""
    force_sum_reduction: bool = False
    """A user's ReduceScatter is called with SUM, never AVG (the engine divides)."""
    requires_all_reduce: bool = True
    """Hybrid meshes: all-reduce across replicas (a 1-D mesh has none)."""
    reduce_scatter_max_input_buffers: int = 1
    """Reductions that may be in flight at once (the context takes the largest
    of its units, at least its own default)."""
    post_optim_event: Any = None
    """An event the next gather waits for (the optimizer step's end)."""
    unshard_async_op: bool = False
    manual_backward_finalization: bool = False
    """Read on the root (FSDP2's ``set_manual_backward_finalization``): the
    backward's end neither waits for reductions nor reduces for units whose
    hook did not fire; ``finalize_backward`` does."""
    keep_unsharded_storage: bool = False
    """Releasing the gathered weights keeps their storage (same addresses at
    the next gather, e.g. for CUDA graphs), at the cost of holding it."""
    on_nonfinite: str | None = None
    """Read on the root: "warn", "error" or "off" for NaN/inf gradients (None:
    FLATFSDP_ON_NONFINITE, else "warn"); Note [the non-finite flag]."""
    is_last_backward: bool = True
    """Read on the root: False means more microbatches follow before the
    optimizer step, so the backward's end need not wait for its reductions."""


def lookup_rows_refusal(state) -> str | None:
    """Why a unit's forward cannot gather only the rows of its ids (None: it can)."""
    tables = [m for m in state.modules if isinstance(m, nn.Embedding)]
    if len(tables) != 1:
        return f"it holds {len(tables)} nn.Embedding modules, not one"
    if tables[0].max_norm is not None:
        return "max_norm renormalises the looked-up rows in place"
    if len(state.groups) != 1:
        return f"it has {len(state.groups)} param groups, not one"
    refusal = getattr(state.groups[0], "rows_refusal", None)
    return "its table is a tensor subclass" if refusal is None else refusal()


def rows_all_local(state) -> bool:
    """The unit's chunk is its whole shard group (world 1, HSDP replicas of one
    rank): every row of its table is already here, so a row lookup has nothing
    to pick from other ranks and its gather moves no bytes either way."""
    return bool(state.groups) and all(getattr(g.buffers.gather_codec, "whole_chunk", False) for g in state.groups)


def needing_weights_in_backward(states: list) -> list:
    """Backward prefetch skips a unit whose backward needs no weights
    (``set_unshard_in_backward(False)``: an embedding lookup's gradient is the
    incoming gradient scattered into rows); gathering it would only move bytes."""
    return [s for s in states if s.controls.unshard_in_backward and not s.controls.lookup_rows_only]


HEAD_START_UNITS = 3
"""Units gathered before a tied head's early reduction: the last to run
forward -- kept gathered or gathered first in backward -- and the two before
it, whose backward then covers the head's transfer."""
