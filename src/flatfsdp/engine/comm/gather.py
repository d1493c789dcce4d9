"""How one group's local model weights become its unsharded buffer.

A group's chunks are gathered in two parts (see layout.build_group_layout):

* **direct** parameters -- large, chunked on dim 0 -- are received straight
  into their slots of the unsharded buffer, which the module's parameters
  view: no copy on either side (one message per parameter and peer with the
  gloo exchange; one in-place all-gather per parameter with a native backend);
* the **staged** rest -- small parameters, and any chunked on another
  dimension -- travel as one contiguous block and are copied into place.

Where the source is (the ZeRO-3 local shard, or this rank's own slots of a
kept unsharded buffer) only changes which views are sent.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist

from flatfsdp.engine.comm import collectives
from flatfsdp.engine.layout import views
from flatfsdp.engine.comm.collectives import Pending
from flatfsdp.engine.layout.device import SideStream
from flatfsdp.engine.layout.arithmetic import GroupLayout
from flatfsdp.engine.layout.switches import Transport


class GatherPlan:
    """The plain gather codec (comm/wire.py): views for gathering one group in
    its compute dtype, built once (buffers keep their views valid across free
    and re-allocation)."""

    travels_alone = False

    def __init__(self, layout: GroupLayout, rank: int, unsharded: torch.Tensor, source: torch.Tensor,
                 source_in_unsharded: bool, transport: Transport, refresh: Callable[[], None],
                 refresh_early: Callable[[], None] | None = None):
        """``refresh``: brings ``source`` up to date from the main weights (the
        group's buffers know how: a copy, a cast, HFSDP's outer gather, which
        ``refresh_early`` starts ahead of time)."""
        self.layout, self.rank, self.unsharded = layout, rank, unsharded
        self.source_in_unsharded = source_in_unsharded
        self.source = source
        self.transport = transport
        self.refresh = refresh
        self.refresh_early = refresh_early or (lambda: None)
        params = layout.params
        self.every = list(range(len(params)))
        self.staged = [i for i in self.every if i not in layout.direct]
        self.direct = list(layout.direct)
        # This rank's own (padded) slot of each direct parameter.
        self.own_slots = {i: self._own_slot(i) for i in self.direct}

    @functools.cached_property
    def landing(self) -> dict[int, list[torch.Tensor]]:
        """Where every rank's slot of each direct parameter lands: only the gloo
        exchange receives slot by slot, and building world x parameters views
        up front would cost seconds per unit at a thousand ranks."""
        params = self.layout.params
        return {i: [views.unsharded_slot(self.unsharded, params[i], r) for r in range(self.layout.world)]
                for i in self.direct}

    @property
    def nbytes(self) -> int:
        """Bytes of the gathered (unsharded) buffer, the size the account counts."""
        return self.layout.unsharded_numel * self.unsharded.element_size()

    @property
    def dtype(self) -> torch.dtype:
        return self.unsharded.dtype

    @property
    def row_bytes(self) -> int:
        """Bytes of this rank's local buffer: its row in a packed gather."""
        return self.layout.shard_numel * self.unsharded.element_size()

    @property
    def device(self) -> torch.device:
        return self.unsharded.device

    def _own_slot(self, index: int) -> torch.Tensor:
        p = self.layout.params[index]
        if self.source_in_unsharded:
            return views.unsharded_slot(self.source, p, self.rank)
        return views.local_slot(self.source, p)

    # ---- the codec's face (comm/wire.py) -------------------------------------------------

    def local_result(self) -> Pending | None:
        return None

    def issue_alone(self, group: dist.ProcessGroup, *, async_op: bool,
                    stream: SideStream | None) -> Pending | None:
        """Straight into the buffer the parameters view (see ``gather``)."""
        return gather(self, group, async_op=async_op, stream=stream)

    def pack(self, row: torch.Tensor) -> None:
        self._pack(row.view(self.dtype), self.every)

    def unpack(self, table: torch.Tensor) -> None:
        self._unpack(table.view(self.dtype), self.every)

    def release(self, keep_rows: bool) -> None:
        """Nothing is kept between a forward and a backward gather."""

    def held(self) -> list[torch.Tensor]:
        return []

    # ---- packing: this rank's contribution as one local-layout row ------------------------

    def _pack(self, row: torch.Tensor, indices: list[int]) -> None:
        """Write this rank's chunks of ``indices`` into ``row`` (local layout)."""
        if not indices:
            return
        if not self.source_in_unsharded:
            end = max(self.layout.params[i].local_offset + self.layout.params[i].slot for i in indices)
            row[:end].copy_(self.source[:end])
            return
        dst = [views.local_chunk(row, self.layout.params[i], self.rank) for i in indices]
        src = [views.unsharded_chunk(self.source, self.layout.params[i], self.rank) for i in indices]
        torch._foreach_copy_(dst, src)

    def _unpack(self, table: torch.Tensor, indices: list[int]) -> None:
        """Copy gathered chunks of ``indices`` into place from a rank-major (W, row)
        table whose columns are this group's local layout."""
        if not indices:
            return
        params = self.layout.params
        pairs = [views.scatter_pairs(self.unsharded, views.wire_slots(table, params[i]), params[i])
                 for i in indices]
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])

    def place_own_direct(self) -> None:
        """A direct parameter's own chunk, when the source is not already in place."""
        if self.source_in_unsharded or not self.direct:
            return
        torch._foreach_copy_([self.landing[i][self.rank] for i in self.direct],
                             [self.own_slots[i] for i in self.direct])


def gather(plan: GatherPlan, group: dist.ProcessGroup, *, async_op: bool,
           stream: SideStream | None = None) -> Pending:
    """Issue the gather of one group; the returned Pending copies the staged
    part into place once it has landed."""
    layout, rank, world = plan.layout, plan.rank, plan.layout.world
    staging = None
    if plan.staged:
        staging = torch.empty(world, layout.staged_numel, dtype=plan.dtype, device=plan.unsharded.device)
        plan._pack(staging[rank], plan.staged)
    if collectives.algorithm(group, plan.transport) == "exchange":
        plan.place_own_direct()
        peers = [q for q in range(world) if q != rank]
        sends, recvs = [], []
        if staging is not None:
            sends += [(q, staging[rank]) for q in peers]
            recvs += [(q, staging[q]) for q in peers]
        for i in plan.direct:
            sends += [(q, plan.own_slots[i]) for q in peers]
            recvs += [(q, plan.landing[i][q]) for q in peers]
        pending = collectives.exchange("all_gather", plan.nbytes, sends, recvs, group, plan.transport)
    else:
        pieces = [] if staging is None else [(staging.view(-1), staging[rank])]
        for i in plan.direct:
            p = layout.params[i]
            start = p.unsharded_offset
            pieces.append((plan.unsharded[start:start + world * p.slot], plan.own_slots[i]))
        pending = collectives.gather_pieces(pieces, group, plan.nbytes, plan.transport, async_op, stream)
    if staging is not None:
        pending.then.append(lambda: plan._unpack(staging, plan.staged))
    return pending
