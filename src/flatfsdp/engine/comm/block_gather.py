"""A group's weights gathered as block-scaled 8-bit codes (``param_gather_dtype``):
a gather codec (comm/wire.py).

Each rank's row on the wire holds three parts, each laid out like a group
layout of its own (so chunk arithmetic and views are the usual ones):

* **codes**: one byte per element of every *coded* parameter -- a matrix or
  higher (``ndim >= 2``) chunked on dim 0, cut into row blocks
  (layout/block_formats.py: a block never crosses a row, so codes do not depend on
  the world size);
* **scales**: one fp32 per block, laid out as a ``(rows, blocks per row)``
  parameter;
* **plain**: everything else in the compute dtype -- vectors (biases, norm
  weights: a fraction of a percent of the bytes, and the parameters most
  sensitive to a coarse grid) and parameters chunked on another dimension.

The row is made from the main weights once per optimizer step (``encode``)
and sent by every gather after it; on arrival each rank's codes are
dequantized straight into the unsharded buffer the module's parameters view
(no staging copy of the decoded weights), this rank's own included, so every
rank computes with the same weights.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from flatfsdp.engine.comm.collectives import Pending
from flatfsdp.engine.layout import views
from flatfsdp.engine.layout.arithmetic import GroupLayout, ParamLayout, build_group_layout
from flatfsdp.engine.layout.block_formats import BlockFormat, dequantize, passes_in_cache, quantize
from flatfsdp.engine.layout.device import SideStream
from flatfsdp.engine.layout.switches import Transport

_BYTE_ALIGN = 16


def _round16(n: int) -> int:
    return -(-n // _BYTE_ALIGN) * _BYTE_ALIGN


def is_coded(p: ParamLayout) -> bool:
    """Whether a parameter travels as codes (else in the compute dtype)."""
    return p.shard_dim == 0 and len(p.shape) >= 2 and p.numel > 0


class BlockRow:
    """Where each part of a rank's row lives: the three sub-layouts and their byte offsets."""

    def __init__(self, layout: GroupLayout, fmt: BlockFormat, compute_dtype: torch.dtype):
        self.layout, self.fmt, self.compute_dtype = layout, fmt, compute_dtype
        params, world = layout.params, layout.world
        self.coded = [i for i, p in enumerate(params) if is_coded(p)]
        self.plain = [i for i, p in enumerate(params) if not is_coded(p)]
        self.codes = build_group_layout([params[i].shape for i in self.coded], world, [0] * len(self.coded))
        self.scales = build_group_layout([(params[i].shape[0], fmt.blocks(params[i].inner)) for i in self.coded],
                                         world, [0] * len(self.coded))
        self.plains = build_group_layout([params[i].shape for i in self.plain], world,
                                         [params[i].shard_dim for i in self.plain])
        itemsize = torch.empty((), dtype=compute_dtype).element_size()
        self.scales_at = _round16(self.codes.shard_numel)
        self.plain_at = _round16(self.scales_at + 4 * self.scales.shard_numel)
        self.nbytes = _round16(self.plain_at + itemsize * self.plains.shard_numel)

    def parts(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, scales, plain) of a byte row (or of every row of a (W, row) table)."""
        codes = row[..., :self.codes.shard_numel]
        scales = row[..., self.scales_at:self.scales_at + 4 * self.scales.shard_numel].view(torch.float32)
        plain = row[..., self.plain_at:self.plain_at + self.plains.shard_numel * _itemsize(self.compute_dtype)]
        return codes, scales, plain.view(self.compute_dtype)

    def encode_rows(self, row: torch.Tensor, chunk: Callable[[int], torch.Tensor], rank: int,
                    rows_of: Callable[[ParamLayout], tuple[int, int]] | None = None) -> None:
        """Quantize ``chunk(i)`` -- rows of group parameter ``i`` in the main
        weights -- into ``row`` (a byte row of this layout). ``rows_of(p)``:
        which rows of ``rank``'s chunk of ``p`` they are, (first, count); by
        default all of them (HFSDP passes its piece)."""
        codes, scales, plain = self.parts(row)
        fmt = self.fmt
        with torch.no_grad():
            for k, i in enumerate(self.coded):
                pc, ps, p = self.codes.params[k], self.scales.params[k], self.layout.params[i]
                first, count = rows_of(p) if rows_of is not None else (0, p.chunk_length(rank))
                if not count:
                    continue
                nb = ps.shape[1]
                x = chunk(i).reshape(count, p.inner)
                c = views.local_slot(codes, pc)[first * p.inner:(first + count) * p.inner].view(count, p.inner)
                s = views.local_slot(scales, ps)[first * nb:(first + count) * nb].view(count, nb)
                quantize(x, fmt, c, s)
            for k, i in enumerate(self.plain):
                pp, p = self.plains.params[k], self.layout.params[i]
                if rows_of is None:
                    views.local_chunk(plain, pp, rank).copy_(chunk(i))
                else:
                    first, count = rows_of(p)
                    views.local_slot(plain, pp)[first * p.inner:(first + count) * p.inner].copy_(chunk(i).reshape(-1))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class BlockScaledGather:
    """Gathers one group as block-scaled rows; always packed (the rows are
    bytes, and every rank's row is decoded into place, its own included)."""

    travels_alone = False
    dtype = torch.uint8

    def __init__(self, layout: GroupLayout, rank: int, unsharded: torch.Tensor, fmt: BlockFormat, *,
                 transport: Transport, main_chunk: Callable[[int], torch.Tensor],
                 replica_gather: Callable[["BlockRow", torch.Tensor], Pending] | None = None,
                 keep_codes: bool = False):
        """``main_chunk(i)``: parameter i's chunk of the main weights, which
        ``refresh`` encodes; ``replica_gather(row, own)`` (HFSDP, from the
        group's replica plan): encode this rank's piece of the main weights and
        gather every replica's into ``own`` instead."""
        self.layout, self.rank, self.unsharded = layout, rank, unsharded
        self.transport = transport
        self._main_chunk, self._replica_gather = main_chunk, replica_gather
        self._early: Pending | None = None
        self.keep_codes = keep_codes
        """Hold every rank's landed row after unpacking (ZeRO-3 groups), so the
        backward gather decodes them again without communicating."""
        self.kept: torch.Tensor | None = None
        """The (world, row) table of the step's codes, while held (Note [kept codes])."""
        self.row = BlockRow(layout, fmt, unsharded.dtype)
        self.own = torch.zeros(self.row.nbytes, dtype=torch.uint8, device=unsharded.device)
        """This rank's row: the quantized copy of its chunks, made once per optimizer step."""
        self.encodes = 0
        """How many times the row was made (tests assert once per optimizer step)."""

    @property
    def row_bytes(self) -> int:
        return self.row.nbytes

    @property
    def nbytes(self) -> int:
        """Bytes the gather moves into every rank (what the account counts)."""
        return self.layout.world * self.row.nbytes

    @property
    def device(self) -> torch.device:
        return self.unsharded.device

    def refresh_early(self) -> None:
        """HFSDP: encode this rank's piece and start gathering every replica's
        across the outer dimension now; ``refresh`` waits for it."""
        if self._replica_gather is not None and self._early is None:
            with torch.no_grad():
                self._early = self._replica_gather(self.row, self.own)

    def refresh(self) -> None:
        """This rank's row from its main weights (HFSDP: from every replica's
        piece, gathered across the outer dimension as codes)."""
        with torch.no_grad():
            if self._replica_gather is not None:
                self.refresh_early()
                self._early, pending = None, self._early
                pending.wait()
            else:
                self.row.encode_rows(self.own, self._main_chunk, self.rank)
        self.encodes += 1
        self.kept = None  # the old step's codes

    def local_result(self) -> Pending | None:
        """The rows kept from this step's forward gather, decoded when the unit
        waits for them (Note [kept codes]); None: nothing kept."""
        if self.kept is None:
            return None

        def decode() -> None:
            self.unpack(self.kept)
            self.kept = None  # backward's decode is the last use this step
        return Pending(label="(kept codes)", then=[decode])

    def issue_alone(self, group: dist.ProcessGroup, *, async_op: bool,
                    stream: SideStream | None) -> Pending | None:
        return None

    def release(self, keep_rows: bool) -> None:
        if not keep_rows:
            self.kept = None

    def held(self) -> list[torch.Tensor]:
        return [self.own]  # the step's codes: this rank's row

    def pack(self, row: torch.Tensor) -> None:
        row.copy_(self.own)

    def _ranks_at_once(self, p, code_slots: torch.Tensor, scale_slots: torch.Tensor, nb: int) -> int:
        """Dequantize the leading ranks whose chunks are whole (``p.chunk`` rows)
        in one pass, where passes are not cache-sized (an accelerator, the
        estimator's fake tensors): at 1,024 ranks a pass a rank is thousands of
        launches a unit. Returns the first rank left to do one by one."""
        if passes_in_cache(code_slots):
            return 0
        whole = p.full_chunks
        if whole < 2:
            return 0
        rows, inner = p.chunk, p.inner
        out = views.unsharded_slots(self.unsharded, p, whole)[:, :rows * inner]
        dequantize(code_slots[:whole, :rows * inner].unflatten(-1, (rows, inner)),
                   scale_slots[:whole, :rows * nb].unflatten(-1, (rows, nb)), self.row.fmt,
                   out.unflatten(-1, (rows, inner)))
        return whole

    def unpack(self, table: torch.Tensor) -> None:
        """Every rank's codes dequantized, and plain chunks copied, into the
        unsharded buffer: rank r's rows of a coded parameter land in its slot."""
        row, fmt, params = self.row, self.row.fmt, self.layout.params
        self.kept = table if self.keep_codes else None
        codes, scales, plain = row.parts(table)
        with torch.no_grad():
            for k, i in enumerate(row.coded):
                pc, ps, p = row.codes.params[k], row.scales.params[k], params[i]
                nb = ps.shape[1]
                code_slots, scale_slots = views.wire_slots(codes, pc), views.wire_slots(scales, ps)
                first = self._ranks_at_once(p, code_slots, scale_slots, nb)
                for r in range(first, self.layout.world):
                    count = p.chunk_length(r)
                    if count:
                        out = views.unsharded_slot(self.unsharded, p, r)[:count * p.inner].view(count, p.inner)
                        dequantize(code_slots[r, :count * p.inner].view(count, p.inner),
                                   scale_slots[r, :count * nb].view(count, nb), fmt, out)
            if row.plain:
                pairs = [views.scatter_pairs(self.unsharded, views.wire_slots(plain, row.plains.params[k]), params[i])
                         for k, i in enumerate(row.plain)]
                torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])


# Note [kept codes]
# ZeRO-3 gathers a unit twice a step, forward and backward, and between an
# optimizer step and the next the codes cannot change. So a ZeRO-3 group's
# plan keeps the table it unpacked (1 byte per element of the unit plus
# scales: a quarter of the fp32 weights) when the unit reshards after a
# training forward; the backward gather decodes it again and drops it,
# moving nothing (ZeRO++'s hpZ keeps a secondary copy for the same reason).
# Any other reshard (after backward, an explicit reshard(), an eval forward)
# and a new encode drop it, so codes are never held past the backward that
# needs them nor decoded for weights they no longer describe.
