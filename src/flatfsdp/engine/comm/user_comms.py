"""A user's FSDP2 collectives as codecs: ``set_custom_all_gather(AllGather)``
and ``set_custom_reduce_scatter(ReduceScatter)``.

FSDP2's Comm classes (torch.distributed.fsdp's ``AllGather`` /
``ReduceScatter``) own two things: where the collective's buffers are
allocated (``allocate(size, dtype=, device=)``: a memory pool, symmetric
memory) and what runs (``__call__``). They are honoured as FSDP2 calls them:

* gather: one ``allocate((world * row,), dtype, device)`` for the output,
  this rank's row packed into its slice of it (the input), one call
  ``comm(output_tensor=, input_tensor=, group=, async_op=)`` per group and
  gather, and the rows unpacked into place once it has landed -- whatever
  the group's own codec packs (the compute dtype, block-scaled codes, a
  subclass's bytes);
* reduce: ``allocate`` for the input (the rank-major gradient buffer is
  copied in) and the output, one call ``comm(output_tensor=, input_tensor=,
  group=, op=, async_op=)``, with ``ReduceOp.AVG`` where FSDP2 passes it (an
  fp32 or bf16 average over exactly the group), else ``SUM`` and the engine
  divides once the sum lands.

Both are counted in the communication account like the engine's own. The
replicas' all-reduce (HSDP) stays the engine's, as in FSDP2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

import torch
import torch.distributed as dist

from flatfsdp.engine.comm import collectives
from flatfsdp.engine.comm.collectives import Pending
from flatfsdp.engine.comm.wire import GatherCodec, PlainReduce
from flatfsdp.engine.layout.device import SideStream
from flatfsdp.engine.layout.switches import Transport


class UserAllGather:
    """A group's gather codec, moved by a user's ``AllGather``."""

    travels_alone = True  # one user call per group, as FSDP2 makes one per param group

    def __init__(self, inner: GatherCodec, comm: Any):
        self.inner, self.comm = inner, comm
        self.transport = inner.transport

    @property
    def row_bytes(self) -> int:
        return self.inner.row_bytes

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    @property
    def device(self) -> torch.device:
        return self.inner.device

    def refresh(self) -> None:
        self.inner.refresh()

    def refresh_early(self) -> None:
        self.inner.refresh_early()

    def local_result(self) -> Pending | None:
        return self.inner.local_result()

    def issue_alone(self, group: dist.ProcessGroup, *, async_op: bool,
                    stream: SideStream | None) -> Pending | None:
        world, rank = group.size(), group.rank()
        dtype = self.inner.dtype
        numel = self.row_bytes // torch.empty((), dtype=dtype).element_size()
        output = self.comm.allocate((world * numel,), dtype=dtype, device=self.device)
        table = output.view(world, numel)
        self.inner.pack(table[rank].view(torch.uint8))

        def issue(a: bool) -> Pending:
            work = self.comm(output_tensor=output, input_tensor=table[rank], group=group, async_op=a)
            return Pending([work] if work is not None else [], group=group)
        pending = collectives.counted("all_gather", self.nbytes, group, self.transport, stream, async_op, issue)
        pending.then.append(lambda: self.inner.unpack(table.view(torch.uint8)))
        return pending

    def pack(self, row: torch.Tensor) -> None:
        self.inner.pack(row)

    def unpack(self, table: torch.Tensor) -> None:
        self.inner.unpack(table)

    def release(self, keep_rows: bool) -> None:
        self.inner.release(keep_rows)

    def held(self) -> list[torch.Tensor]:
        return self.inner.held()


@dataclass(frozen=True)
class UserReduceScatter:
    """A group's gradient reduce-scatter, moved by a user's ``ReduceScatter``."""

    comm: Any
    transport: Transport

    @property
    def key(self) -> Hashable:
        return ("user", id(self.comm))

    def averages(self, divisor: float, group: dist.ProcessGroup, dtype: torch.dtype) -> bool:
        """FSDP2's choice (``_get_gradient_divide_factors``): AVG for an fp32 or
        bf16 average over exactly this group; otherwise SUM, divided after."""
        return group.size() > 1 and divisor == group.size() and dtype in (torch.float32, torch.bfloat16)

    def reduce_scatter(self, output: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup, *,
                       async_op: bool, stream: SideStream | None, average: bool = False) -> Pending:
        comm_input = self.comm.allocate((flat.numel(),), dtype=flat.dtype, device=flat.device)
        comm_input.copy_(flat.view(-1))
        comm_output = self.comm.allocate((output.numel(),), dtype=output.dtype, device=output.device)
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM

        def issue(a: bool) -> Pending:
            work = self.comm(output_tensor=comm_output, input_tensor=comm_input, group=group, op=op, async_op=a)
            return Pending([work] if work is not None else [], group=group)
        pending = collectives.counted("reduce_scatter", collectives.nbytes(flat), group, self.transport, stream,
                                      async_op, issue)
        pending.then.append(lambda: output.copy_(comm_output))
        return pending

    def all_reduce(self, flat: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False,
                   stream: SideStream | None = None) -> Pending:
        return PlainReduce(self.transport).all_reduce(flat, group, async_op=async_op, stream=stream)


def check_comm(comm: Any, kind: str, unit: str) -> None:
    """``comm`` must be a Comm as FSDP2 takes it: ``allocate`` and a call (an
    instance of FSDP2's ``AllGather`` / ``ReduceScatter`` where this torch has
    them; torch keeps them in a private module, so they are not required)."""
    if not (callable(comm) and callable(getattr(comm, "allocate", None))):
        raise TypeError(f"unit '{unit}': set_custom_{kind} takes an FSDP2 Comm with allocate(size, dtype=, "
                        f"device=) and __call__, got {type(comm).__name__}")
