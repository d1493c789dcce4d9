"""HFSDP: a group's main weights, main grads and optimizer state sharded across
the outer dimension too, its model weights and gradients across the inner
(shard) dimension only.

Rank (o, i) of an (outer, inner) mesh holds inner chunk i of every parameter,
as ZeRO-3 over the inner group would, and of that chunk the o-th of ``outer``
equal pieces: rows ``[(i * outer + o) * c, ... + c)`` of a dim-0 parameter of
``n`` rows, ``c = n / (inner * outer)``. DTensor places that local tensor
``(_StridedShard(0, split_factor=inner), Shard(0))`` on the ``(outer, inner)``
mesh -- the placement FSDP2 gives a data-parallel chunk of a tensor-parallel
shard -- and DTensor supports it for even chunks only, so a group is hybrid
only when every parameter's dim 0 divides by ``inner x outer`` (the others
stay in an HSDP group, replicated across the outer dimension).

Per optimizer step the outer dimension carries one reduce-scatter of the
inner-reduced gradients and one all-gather of the updated weights, both over
an ``(outer, pieces)`` table that this module packs from and unpacks into the
inner chunk buffer (whose layout keeps each parameter's chunk contiguous, so
the per-use inner gathers stay zero-copy).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flatfsdp.engine import collectives
from flatfsdp.engine.layout import GroupLayout, build_group_layout


def splits_evenly(shape: tuple[int, ...], shard_dim: int | None, ranks: int) -> bool:
    """Whether a parameter can be hybrid-sharded over ``ranks`` = inner x outer."""
    return shard_dim == 0 and len(shape) > 0 and shape[0] % ranks == 0


class OuterShard:
    """This rank's piece of a group's inner chunks, and the two outer collectives."""

    def __init__(self, inner: GroupLayout, outer_group: dist.ProcessGroup, inner_rank: int):
        self.inner, self.group = inner, outer_group
        self.outer = outer_group.size()
        world = inner.world * self.outer
        shapes = [p.shape for p in inner.params]
        if not all(splits_evenly(s, p.shard_dim, world) for s, p in zip(shapes, inner.params)):
            raise ValueError("an HFSDP group holds only parameters whose dim 0 divides by inner x outer ranks")
        self.pieces = build_group_layout(shapes, world, [0] * len(shapes))
        """The main weights' layout: one piece (n / world rows) per parameter."""
        self.index = inner_rank * self.outer + outer_group.rank()
        """Which of the ``world`` pieces this rank holds (rows ``index * c``...)."""

    @property
    def numel(self) -> int:
        """Elements of this rank's piece buffer (main weights, main grads)."""
        return self.pieces.shard_numel

    def _pairs(self, table: torch.Tensor, local: torch.Tensor) -> tuple[list, list]:
        """(table views, inner-chunk views): parameter p's chunk seen as
        ``outer`` pieces, against its column block of the (outer, pieces) table."""
        rows = table.view(self.outer, self.pieces.shard_numel)
        tables, chunks = [], []
        for p, q in zip(self.inner.params, self.pieces.params):
            tables.append(rows[:, q.local_offset:q.local_offset + q.slot])
            chunks.append(local[p.local_offset:p.local_offset + p.slot].view(self.outer, q.slot))
        return tables, chunks

    def reduce_scatter(self, chunk_sums: torch.Tensor, out: torch.Tensor) -> None:
        """Sum the inner-reduced gradient chunks (inner layout) across the
        outer group; this rank's piece lands in ``out`` (piece layout)."""
        table = torch.zeros(self.outer * self.numel, dtype=chunk_sums.dtype, device=chunk_sums.device)
        tables, chunks = self._pairs(table, chunk_sums)
        torch._foreach_copy_(tables, chunks)
        collectives.reduce_scatter(out, table, self.group).wait()

    def all_gather(self, piece: torch.Tensor, chunks_out: torch.Tensor) -> None:
        """Every replica's updated piece (cast to ``chunks_out``'s dtype) into
        this rank's inner chunk buffer: once per optimizer step."""
        table = torch.empty(self.outer * self.numel, dtype=chunks_out.dtype, device=chunks_out.device)
        mine = table[self.group.rank() * self.numel:(self.group.rank() + 1) * self.numel]
        mine.copy_(piece)
        collectives.all_gather(table, mine, self.group).wait()
        tables, chunks = self._pairs(table, chunks_out)
        torch._foreach_copy_(chunks, tables)
