"""Gathering only the rows of an embedding table that a batch's ids touch.

An embedding's forward reads the rows of its input ids, not the table. Its
weight is chunked on dim 0 (each rank holds a contiguous run of rows, see
layout.arithmetic), so every rank's rows come in one collective: the ranks
share their ids (an all-gather of a few KB), each writes the rows of the
union that it holds into a (rows x width) table, zeros elsewhere, and a sum
over the group hands every rank every row -- exactly, since each element has
one nonzero term (x + 0 == x). The rows land in their places in the unsharded
buffer; the rest of it is left unwritten, and the lookup never reads it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flatfsdp.engine.comm import collectives
from flatfsdp.engine.comm.gather import GatherPlan
from flatfsdp.engine.layout import views
from flatfsdp.engine.layout.switches import Transport


def union_of_ids(ids: torch.Tensor, group: dist.ProcessGroup, transport: Transport) -> torch.Tensor:
    """The sorted distinct ids over every rank of ``group`` (ranks may hold different counts)."""
    mine = ids.reshape(-1).to(torch.int64).unique()
    counts = torch.zeros(group.size(), dtype=torch.int64, device=mine.device)
    collectives.all_gather(counts, torch.tensor([mine.numel()], device=mine.device), group, transport,
                           kind="lookup_ids").wait()
    longest = int(counts.max())
    padded = torch.full((longest,), -1, dtype=torch.int64, device=mine.device)
    padded[:mine.numel()] = mine
    everyone = torch.empty(group.size() * longest, dtype=torch.int64, device=mine.device)
    collectives.all_gather(everyone, padded, group, transport, kind="lookup_ids").wait()
    return everyone[everyone >= 0].unique()


def gather_rows(plan: GatherPlan, index: int, ids: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Fill the rows ``ids`` (on any rank of ``group``) of parameter ``index``
    in ``plan``'s unsharded buffer from the ranks' local chunks; returns the
    rows that travelled (sorted, the same on every rank). ``plan.source``
    must be current (the caller refreshes it)."""
    p = plan.layout.params[index]
    if p.shard_dim != 0:
        raise ValueError(f"a row lookup needs the table chunked on dim 0, not dim {p.shard_dim}")
    needed = union_of_ids(ids, group, plan.transport).to(plan.device)
    width, rank = p.numel // p.shape[0], plan.rank
    table = torch.zeros(needed.numel(), width, dtype=plan.dtype, device=plan.device)
    start, length = p.chunk_start(rank), p.chunk_length(rank)
    if length:
        local = views.local_chunk(plan.source, p, rank).reshape(length, width)
        held = (needed >= start) & (needed < start + length)
        table[held] = local[needed[held] - start]
    # async + wait: the host's wait is booked as exposed communication (comm_account().waited())
    collectives.all_reduce(table, group, plan.transport, async_op=True, kind="lookup_rows").wait()
    views.unsharded_param(plan.unsharded, p).view(p.shape[0], width)[needed] = table
    return needed


class RowsReduce:
    """The reduce codec of a row-lookup table (see the module's note): its
    gradient is nonzero only in the rows the forward looked up, so only those
    rows travel -- one all-reduce of (rows x width), after which each rank
    keeps the rows it holds and zeros the rest of its shard. A reduce-scatter
    is linear: summing just the nonzero rows gives the same shard (bit for bit
    at two ranks, where either collective adds the same two numbers).

    The rows are noted by every forward since the last reduction (their
    union: microbatches accumulate); without any (a forward that gathered
    the table whole), the reduction is the plain dense one. So is one whose
    gradients include a dense one (a tied output head's, which reaches the
    engine on a leaf of its own: ParamGroup.install_faces); where that came
    alone, the lookup's rows are kept for the reduction after. Synchronous: it
    is the step's last reduction and small, and a host-side scatter must land
    before HSDP's replica all-reduce reads the shard."""

    def __init__(self, plain, layout, index: int, rank: int):
        self.plain, self.transport = plain, plain.transport
        self.p, self.rank = layout.params[index], rank
        self._rows: torch.Tensor | None = None
        self._lookup = self._dense = False
        self._landed: tuple | None = None
        """(output, the chunk's rows written) of the last row reduction, for HSDP's all-reduce after it."""

    @property
    def key(self):
        return ("rows", id(self))  # never packed with another group's reduction

    def averages(self, divisor: float, group: dist.ProcessGroup, dtype: torch.dtype) -> bool:
        return False

    def note_rows(self, rows: torch.Tensor) -> None:
        """A forward looked up ``rows`` (the same on every rank)."""
        self._rows = rows if self._rows is None else torch.cat([self._rows, rows]).unique()

    def note_accumulated(self, *, lookup: bool, dense: bool) -> None:
        """What the accumulation about to be reduced holds: the lookup's
        gradient (rows only), a dense one (a tied head's), or both."""
        self._lookup |= lookup
        self._dense |= dense

    def reduce_scatter(self, output: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup, *,
                       async_op: bool, stream, average: bool = False) -> collectives.Pending:
        lookup, dense = self._lookup, self._dense
        self._lookup = self._dense = False
        self._landed = None  # whatever follows now also holds this reduction's sums
        rows = None
        if lookup or not dense:  # the lookup's gradient goes now (a tied head's alone: its rows wait)
            rows, self._rows = self._rows, None
        if rows is None or dense:
            return self.plain.reduce_scatter(output, flat, group, async_op=async_op, stream=stream, average=average)
        p, world = self.p, group.size()
        width = p.numel // p.shape[0]
        slots = flat.view(world, -1)[:, p.local_offset:p.local_offset + p.chunk * width].view(world, p.chunk, width)
        owner = rows // p.chunk
        offset = rows - owner * p.chunk
        picked = slots[owner, offset]  # a copy: (rows x width)
        collectives.all_reduce(picked, group, self.transport, async_op=True, kind="reduce_rows").wait()
        output.zero_()
        mine = owner == self.rank
        output[p.local_offset:p.local_offset + p.chunk * width].view(p.chunk, width)[offset[mine]] = picked[mine]
        self._landed = (output, offset[mine])
        return collectives.Pending([], group=group)

    def all_reduce(self, flat: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False,
                   stream=None) -> collectives.Pending:
        """HSDP's sum across replicas. After a row reduction only the rows
        this shard holds are nonzero, so only those travel: the replicas
        (each the same shard of its own copy) share which rows they hold --
        they looked up different ids -- and all-reduce the union of them,
        each contributing zeros where it had none."""
        landed, self._landed = self._landed, None
        if landed is None or landed[0] is not flat:
            return self.plain.all_reduce(flat, group, async_op=async_op, stream=stream)
        p = self.p
        width = p.numel // p.shape[0]
        chunk = flat[p.local_offset:p.local_offset + p.chunk * width].view(p.chunk, width)
        rows = union_of_ids(landed[1], group, self.transport)
        picked = chunk[rows]
        collectives.all_reduce(picked, group, self.transport, async_op=True, kind="reduce_rows").wait()
        chunk[rows] = picked
        return collectives.Pending([], group=group)
