"""HFSDP: a group's main weights, main grads and optimizer state sharded across
the outer dimension too, its model weights and gradients across the inner
(shard) dimension only.

Rank (o, i) of an (outer, inner) mesh holds inner chunk i of every parameter,
``torch.chunk(param, inner)[i]`` as ZeRO-3 over the inner group would, and of
that chunk the piece ``torch.chunk(chunk, outer)[o]``: DTensor's
``(Shard(0), Shard(0))`` on the transposed ``(inner, outer)`` mesh, for any
size. (FSDP2's ``_StridedShard`` on the ``(outer, inner)`` mesh would say the
same, but torch supports it for even chunks only.)

Per optimizer step the outer dimension carries one reduce-scatter of the
inner-reduced gradients and one all-gather of the updated weights, both over
an ``(outer, pieces)`` table this module packs from and unpacks into the
inner chunk buffer (whose layout keeps each parameter's chunk contiguous, so
the per-use inner gathers stay zero-copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from flatfsdp.engine.comm import collectives
from flatfsdp.engine.comm.collectives import Pending
from flatfsdp.engine.layout.arithmetic import ALIGN, GroupLayout, ParamLayout
from flatfsdp.engine.layout.block_formats import quantize
from flatfsdp.engine.layout.switches import Transport


@dataclass(frozen=True)
class _Piece:
    """Parameter ``p``'s pieces: where each outer rank's rows start in the
    inner chunk, how many, and the slot in the pieces table."""

    p: ParamLayout
    offset: int
    """In the pieces buffer (elements)."""
    slot: int
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    """Rows of piece o (per outer rank o), for this rank's inner chunk."""


class OuterShard:
    """This rank's piece of a group's inner chunks, and the two outer collectives."""

    def __init__(self, inner: GroupLayout, outer_group: dist.ProcessGroup, inner_rank: int, transport: Transport):
        self.inner, self.group, self.inner_rank = inner, outer_group, inner_rank
        self.transport = transport
        self._code_parts: tuple | None = None
        self.outer, self.rank = outer_group.size(), outer_group.rank()
        pieces, cursor = [], 0
        for p in inner.params:
            if p.shard_dim != 0:
                raise ValueError("an HFSDP group holds only parameters chunked on dim 0")
            rows = p.chunk_length(inner_rank)  # this rank's inner chunk
            per = -(-rows // self.outer)
            starts = tuple(min(o * per, rows) for o in range(self.outer))
            lengths = tuple(min(rows, (o + 1) * per) - starts[o] for o in range(self.outer))
            slot = -(-p.chunk // self.outer) * p.inner  # the fullest inner chunk's piece
            cursor = -(-cursor // ALIGN) * ALIGN
            pieces.append(_Piece(p, cursor, slot, starts, lengths))
            cursor += slot
        self.pieces = pieces
        self.numel = -(-cursor // ALIGN) * ALIGN
        """Elements of this rank's piece buffer (main weights, main grads)."""

    # ---- this rank's piece of parameter ``index`` ------------------------------------------

    def piece_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """This rank's piece of parameter ``index`` in a pieces-layout buffer, at its true shape."""
        q = self.pieces[index]
        rows = q.lengths[self.rank]
        return flat[q.offset:q.offset + rows * q.p.inner].view(rows, *q.p.shape[1:])

    def piece_of(self, full: torch.Tensor, index: int, inner_rank: int) -> torch.Tensor:
        """This rank's piece of a full-size value of parameter ``index``."""
        q = self.pieces[index]
        return full.narrow(0, q.p.chunk_start(inner_rank) + q.starts[self.rank], q.lengths[self.rank])

    # ---- the outer collectives ---------------------------------------------------------------

    def _pairs(self, table: torch.Tensor, local: torch.Tensor) -> tuple[list, list]:
        """(table views, inner-chunk views) of every non-empty piece of every
        outer rank, against its row of the (outer, pieces) table."""
        rows = table.view(self.outer, self.numel)
        tables, chunks = [], []
        for q in self.pieces:
            for o, (start, length) in enumerate(zip(q.starts, q.lengths)):
                if length:
                    n = length * q.p.inner
                    tables.append(rows[o, q.offset:q.offset + n])
                    begin = q.p.local_offset + start * q.p.inner
                    chunks.append(local[begin:begin + n])
        return tables, chunks

    def reduce_scatter(self, chunk_sums: torch.Tensor, out: torch.Tensor) -> Pending:
        """Sum the inner-reduced gradient chunks (inner layout) across the
        outer group; this rank's piece lands in ``out`` (pieces layout) once
        the returned collective has."""
        table = torch.zeros(self.outer * self.numel, dtype=chunk_sums.dtype, device=chunk_sums.device)
        tables, chunks = self._pairs(table, chunk_sums)
        if tables:
            torch._foreach_copy_(tables, chunks)
        return collectives.reduce_scatter(out, table, self.group, self.transport, async_op=True)

    def all_gather(self, piece: torch.Tensor, chunks_out: torch.Tensor) -> Pending:
        """Every replica's updated piece (cast to ``chunks_out``'s dtype) into
        this rank's inner chunk buffer, once the returned collective has
        landed: once per optimizer step."""
        table = torch.empty(self.outer * self.numel, dtype=chunks_out.dtype, device=chunks_out.device)
        mine = table[self.rank * self.numel:(self.rank + 1) * self.numel]
        mine.copy_(piece)
        pending = collectives.all_gather(table, mine, self.group, self.transport, async_op=True)

        def place() -> None:
            tables, chunks = self._pairs(table, chunks_out)
            if tables:
                torch._foreach_copy_(chunks, tables)
        pending.then.append(place)
        return pending

    # ---- block-scaled weights (param_gather_dtype) --------------------------------------------

    def all_gather_codes(self, piece: torch.Tensor, row, own: torch.Tensor) -> Pending:
        """Once per optimizer step: this rank's piece of the main weights as
        codes, scales and plain values, gathered across the outer dimension
        as bytes straight into ``own``, the row the inner gathers send (``row``:
        its block_gather.BlockRow layout). Codes
        are per row block and pieces are whole rows, so a piece's codes are
        the same bytes as its rows' codes in the chunk (Note [low-bit blocks])."""
        if self._code_parts is None:
            shards = [OuterShard(sub, self.group, self.inner_rank, self.transport)
                      for sub in (row.codes, row.scales, row.plains)]
            device = piece.device
            buffers = [torch.zeros(shard.numel, dtype=dtype, device=device)
                       for shard, dtype in zip(shards, (torch.uint8, torch.float32, row.compute_dtype))]
            self._code_parts = (shards, buffers)
        (codes, scales, plains), (code_piece, scale_piece, plain_piece) = self._code_parts
        with torch.no_grad():
            for k, i in enumerate(row.coded):
                x = self.piece_view(piece, i)
                if x.shape[0]:
                    count = x.shape[0]
                    quantize(x.reshape(count, -1), row.fmt, codes.piece_view(code_piece, k).reshape(count, -1),
                             scales.piece_view(scale_piece, k))
            for k, i in enumerate(row.plain):
                plains.piece_view(plain_piece, k).copy_(self.piece_view(piece, i))
            gathers = [shard.all_gather(part, out) for shard, part, out in
                       zip((codes, scales, plains), (code_piece, scale_piece, plain_piece), row.parts(own))
                       if shard.numel]
        return Pending.joined(gathers, group=self.group, label="(outer all_gather)",
                              timeout_s=self.transport.timeout_s, kind="all_gather")

