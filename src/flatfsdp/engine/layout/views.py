"""Tensor views over a group's flat buffers, from the layout's numbers.

Every function returns views (no copies) of a flat 1-D tensor; buffers freed
and re-allocated by resizing their storage keep these views valid, so they
are built once per group and reused every step.
"""

from __future__ import annotations

import torch

from flatfsdp.engine.layout.arithmetic import GroupLayout, ParamLayout


def same_start(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` begin at the same byte of the same storage.
    Told by storage identity and offset rather than ``data_ptr``, so it also
    holds for fake tensors (the estimator's), whose addresses are all 0."""
    return (a.untyped_storage() is b.untyped_storage()
            and a.storage_offset() * a.element_size() == b.storage_offset() * b.element_size())


def local_slot(local: torch.Tensor, p: ParamLayout) -> torch.Tensor:
    """The padded chunk slot of ``p`` in a local buffer (1-D, ``p.slot`` elements)."""
    return local[p.local_offset:p.local_offset + p.slot]


def local_chunk(local: torch.Tensor, p: ParamLayout, rank: int) -> torch.Tensor:
    """``rank``'s chunk of ``p`` in a local buffer, at the chunk's true shape."""
    return local[p.local_offset:p.local_offset + p.chunk_numel(rank)].view(p.chunk_shape(rank))


def unsharded_param(unsharded: torch.Tensor, p: ParamLayout) -> torch.Tensor:
    """The whole parameter in the unsharded buffer."""
    return unsharded[p.unsharded_offset:p.unsharded_offset + p.numel].view(p.shape)


def unsharded_slot(unsharded: torch.Tensor, p: ParamLayout, rank: int) -> torch.Tensor:
    """Where ``rank``'s (padded) chunk of a dim-0 or replicated parameter lands in
    the unsharded buffer: contiguous, so a chunk can be received into it."""
    start = p.unsharded_offset + rank * p.slot
    return unsharded[start:start + p.slot]


def unsharded_slots(unsharded: torch.Tensor, p: ParamLayout, ranks: int) -> torch.Tensor:
    """The slots of ranks 0 .. ``ranks`` - 1 (``unsharded_slot``, back to back) as a (ranks, slot) view."""
    start = p.unsharded_offset
    return unsharded[start:start + ranks * p.slot].view(ranks, p.slot)


def chunk_of(full: torch.Tensor, p: ParamLayout, rank: int) -> torch.Tensor:
    """``rank``'s chunk of a full-shape value of ``p`` (the whole of it when replicated)."""
    if p.shard_dim is None:
        return full
    return full.narrow(p.shard_dim, p.chunk_start(rank), p.chunk_length(rank))


def unsharded_chunk(unsharded: torch.Tensor, p: ParamLayout, rank: int) -> torch.Tensor:
    """``rank``'s chunk of ``p`` inside the unsharded buffer, at its true shape
    (contiguous for dim 0, strided for other dimensions)."""
    return chunk_of(unsharded_param(unsharded, p), p, rank)


def wire_slots(table: torch.Tensor, p: ParamLayout) -> torch.Tensor:
    """``p``'s slot in every rank's row of a rank-major (W x row) wire table: a
    (W, slot) view."""
    return table[:, p.local_offset:p.local_offset + p.slot]


def wire_table(wire: torch.Tensor, layout: GroupLayout) -> torch.Tensor:
    """A flat rank-major buffer of the group as its (W, S) table."""
    return wire.view(layout.world, layout.shard_numel)


def scatter_pairs(unsharded: torch.Tensor, wire_view: torch.Tensor, p: ParamLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(destination in the unsharded buffer, source) to copy a gathered (W, slot)
    wire view of ``p`` into place."""
    if p.shard_dim in (None, 0):
        start = p.unsharded_offset
        return unsharded[start:start + p.world * p.slot].view(p.world, p.slot), wire_view
    d = p.shard_dim
    full = unsharded_param(unsharded, p)
    split = full.view(*p.shape[:d], p.world, p.chunk, *p.shape[d + 1:]).movedim(d, 0)
    return split, wire_view.view(p.world, *p.chunk_shape(0))


# ---- gradients into the wire layout ----------------------------------------------------------

def grad_destinations(wire: torch.Tensor, layout: GroupLayout, p: ParamLayout) -> list[torch.Tensor]:
    """Where a full-shape gradient of ``p`` goes in a rank-major gradient
    buffer, as the views ``grad_sources`` pairs with."""
    if p.shard_dim is None:
        return [unsharded_param(wire, p)]
    slots = wire_slots(wire_table(wire, layout), p)
    if p.shard_dim > 0:
        return [slots.view(p.world, *p.chunk_shape(0))]
    full, out = p.full_chunks, []
    if full:
        out.append(slots[:full])
    if full < p.world and p.chunk_length(full):
        out.append(slots[full, :p.chunk_numel(full)])
    return out


def grad_sources(grad: torch.Tensor, p: ParamLayout) -> list[torch.Tensor]:
    """``grad`` (the parameter's full shape) cut to match ``grad_destinations``."""
    if p.shard_dim is None:
        return [grad]
    if p.shard_dim > 0:
        d = p.shard_dim
        return [grad.view(*p.shape[:d], p.world, p.chunk, *p.shape[d + 1:]).movedim(d, 0)]
    flat, full, out = grad.reshape(-1), p.full_chunks, []
    if full:
        out.append(flat[:full * p.slot].view(full, p.slot))
    if full < p.world and p.chunk_length(full):
        out.append(flat[full * p.slot:])
    return out


def grad_padding(wire: torch.Tensor, layout: GroupLayout, p: ParamLayout) -> list[torch.Tensor]:
    """The parts of ``p``'s slots no gradient element lands in (uneven chunks)."""
    if p.shard_dim is None or p.shard_dim > 0:
        return []
    slots, full, out = wire_slots(wire_table(wire, layout), p), p.full_chunks, []
    first_empty = full
    if full < p.world and p.chunk_length(full):
        out.append(slots[full, p.chunk_numel(full):])
        first_empty = full + 1
    if first_empty < p.world:
        out.append(slots[first_empty:])
    return [t for t in out if t.numel()]


def gaps(flat: torch.Tensor, layout: GroupLayout, rows: int) -> list[torch.Tensor]:
    """Alignment padding between slots, in each of ``rows`` rows of a flat buffer
    of ``rows`` x S elements (1 for a local buffer, W for a wire buffer)."""
    table = flat.view(rows, layout.shard_numel)
    out, cursor = [], 0
    for p in sorted(layout.params, key=lambda q: q.local_offset):
        if p.local_offset > cursor:
            out.append(table[:, cursor:p.local_offset])
        cursor = p.local_offset + p.slot
    if cursor < layout.shard_numel:
        out.append(table[:, cursor:])
    return out
