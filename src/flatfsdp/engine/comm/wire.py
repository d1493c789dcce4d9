"""How a param group's bytes travel: a gather codec and a reduce codec,
chosen once per group (like its placement) and carried by every request.

Nothing below the point of choice (groups/wire_choice.py) asks which codec
it holds: coalescing packs any gather codec's rows into one collective and
buckets reductions by their codec's ``key``; a codec does the rest. The
codecs:

==========================  ====================================================
gather                      what travels
==========================  ====================================================
``gather.GatherPlan``       the compute dtype, zero copy where it can
``block_gather.BlockScaledGather``  block-scaled 8-bit codes (layout/block_formats)
``cast_gather.CastGather``  nothing: a shard group of one casts its main weights
``SubclassGatherPlan``      a tensor subclass's own all-gather inputs, as bytes
``user_comms.UserAllGather``  a user's FSDP2 ``AllGather`` around any of those
==========================  ====================================================

==========================  ====================================================
reduce                      what travels
==========================  ====================================================
``PlainReduce``             the reduction dtype (gloo exchange or native)
``block_reduce.BlockScaledReduce``  block-scaled codes, summed in fp32
``user_comms.UserReduceScatter``  a user's FSDP2 ``ReduceScatter``
==========================  ====================================================

How replicas split the main weights (HFSDP, groups/replicas.py) is not a
codec: it decides what the main weights hold, and each codec reads them
through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Protocol

import torch
import torch.distributed as dist

from flatfsdp.engine.comm import collectives
from flatfsdp.engine.comm.collectives import Pending
from flatfsdp.engine.layout.device import SideStream
from flatfsdp.engine.layout.switches import Transport


class GatherCodec(Protocol):
    """How one group's weights become every rank's unsharded buffer."""

    transport: Transport

    @property
    def row_bytes(self) -> int:
        """Bytes of this rank's row when packed with other groups' rows."""

    @property
    def nbytes(self) -> int:
        """Bytes the gather moves into every rank: what the account counts."""

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype:
        """The element type of a row (what a user's AllGather allocates)."""

    @property
    def travels_alone(self) -> bool:
        """Never packed with other groups (a user's collective is called per group)."""

    def refresh(self) -> None:
        """This rank's row from the main weights, before a gather that needs it
        (the group decides when: once per optimizer step, or every gather)."""

    def refresh_early(self) -> None:
        """Start what ``refresh`` needs from other ranks without waiting
        (HFSDP's gather across the outer dimension); a no-op for most codecs."""

    def local_result(self) -> Pending | None:
        """Every rank's row is here already (kept codes): decode, move nothing; None otherwise."""

    def issue_alone(self, group: dist.ProcessGroup, *, async_op: bool,
                    stream: SideStream | None) -> Pending | None:
        """Gather this group by itself, straight into place (or from rows it
        kept); None: it only travels packed."""

    def pack(self, row: torch.Tensor) -> None:
        """This rank's row, as bytes, into ``row`` (uint8)."""

    def unpack(self, table: torch.Tensor) -> None:
        """Every rank's row, from the gathered (world, row_bytes) uint8 table, into place."""

    def release(self, keep_rows: bool) -> None:
        """The gathered weights are released; ``keep_rows``: a training forward
        ended and its backward gathers again (Note [kept codes])."""

    def held(self) -> list[torch.Tensor]:
        """Tensors held between steps besides the group's buffers (accounting)."""


class ReduceCodec(Protocol):
    """How one group's gradients are summed across ranks."""

    transport: Transport

    @property
    def key(self) -> Hashable:
        """Requests whose codecs have equal keys (over the same groups) may share one collective."""

    def averages(self, divisor: float, group: dist.ProcessGroup, dtype: torch.dtype) -> bool:
        """Whether the collective itself divides by ``divisor`` (FSDP2's
        ``ReduceOp.AVG``); otherwise the sum is divided once it lands."""

    def reduce_scatter(self, output: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup, *,
                       async_op: bool, stream: SideStream | None, average: bool = False) -> Pending:
        """Chunk r of ``flat``, summed (averaged) over ``group``, into rank r's ``output``."""

    def all_reduce(self, flat: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False,
                   stream: SideStream | None = None) -> Pending:
        """``flat`` summed over ``group``, in place."""


@dataclass(frozen=True)
class PlainReduce:
    """Gradients travel in their reduction dtype."""

    transport: Transport

    @property
    def key(self) -> Hashable:
        return ("plain",)

    def averages(self, divisor: float, group: dist.ProcessGroup, dtype: torch.dtype) -> bool:
        return False

    def reduce_scatter(self, output: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup, *,
                       async_op: bool, stream: SideStream | None, average: bool = False) -> Pending:
        return collectives.reduce_scatter(output, flat, group, self.transport, async_op, stream)

    def all_reduce(self, flat: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False,
                   stream: SideStream | None = None) -> Pending:
        return collectives.all_reduce(flat, group, self.transport, async_op, stream)
