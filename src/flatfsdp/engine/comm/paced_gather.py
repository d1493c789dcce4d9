"""A row-lookup table gathered whole for a module that reads it later in the
same forward (a tied output head), in slices of rows posted one at a time.

Why slices: messages between a pair of ranks leave in the order they were
posted. A table of tens of MB posted whole sits in front of every block's
gather posted after it, and on a slow link the next block then waits for the
whole table. Posted a slice at each unit's forward (after that unit's own
prefetch), the table takes the link time the blocks' compute leaves free, and
a block's gather waits for one slice at most. Waiting for the table (the
head's forward) posts what is left at once.

Each rank's chunk is a run of whole rows (dim 0), so slice j of every chunk
is contiguous at both ends: it is sent from the rank's chunk of the gather
source and received straight into the unsharded buffer.
"""

from __future__ import annotations

import math

import torch.distributed as dist

from flatfsdp.engine.comm.collectives import Pending, dim_name
from flatfsdp.engine.comm.comm_account import comm_account
from flatfsdp.engine.comm.exchange import post_messages
from flatfsdp.engine.comm.gather import GatherPlan
from flatfsdp.engine.layout import views


class PacedGather:
    """Parameter ``index`` of ``plan``, whole, in ``slices`` slices: ``pump``
    posts the next, ``wait`` posts the rest and waits (a pending gather)."""

    def __init__(self, plan: GatherPlan, index: int, group: dist.ProcessGroup, slices: int, label: str):
        p = plan.layout.params[index]
        world, me = group.size(), group.rank()
        width = p.numel // p.shape[0]
        full = views.unsharded_param(plan.unsharded, p).view(p.shape[0], width)
        starts = [p.chunk_start(r) for r in range(world)]
        lengths = [p.chunk_length(r) for r in range(world)]
        mine = full[starts[me]:starts[me] + lengths[me]]
        if lengths[me]:
            local = views.local_chunk(plan.source, p, me).reshape(lengths[me], width)
            if not views.same_start(mine, local):
                mine.copy_(local)
        step = max(1, math.ceil(max(lengths) / max(1, slices)))
        peers = [r for r in range(world) if r != me]
        self._pieces = []
        for first in range(0, max(lengths), step):
            sends = [(peer, mine[first:first + step]) for peer in peers if first < lengths[me]]
            recvs = [(peer, full[starts[peer] + first:starts[peer] + min(first + step, lengths[peer])])
                     for peer in peers if first < lengths[peer]]
            self._pieces.append((sends, recvs))
        self.group, self.label, self.timeout_s = group, label, plan.transport.timeout_s
        self._works: list = []
        self._ticket = comm_account().add("all_gather", p.numel * full.element_size(), dim_name(group), world,
                                          paced=True)

    @property
    def posted_all(self) -> bool:
        return not self._pieces

    def pump(self) -> None:
        """Post the next slice (nothing once all are posted)."""
        if self._pieces:
            sends, recvs = self._pieces.pop(0)
            self._works += post_messages(sends, recvs, self.group)
            # What the slice adds to the gather's buffer: every rank's part of its rows.
            comm_account().posted(self._ticket, sum(t.numel() * t.element_size() for _, t in recvs)
                                  + sum(t.numel() * t.element_size() for _, t in sends[:1]))

    def wait(self) -> None:
        while self._pieces:
            self.pump()
        works, self._works = self._works, []
        Pending([w for w, _ in works], peers=[peer for _, peer in works], group=self.group, label=self.label,
                timeout_s=self.timeout_s, kind="all_gather", tickets=[self._ticket]).wait()  # timed, and a missing peer named
