"""Gradients reduce-scattered as block-scaled codes (``grad_reduce_dtype="int8"``,
``"fp8"``, ``"e5m2"``): a reduce codec (comm/wire.py).

ZeRO++'s quantized gradient reduction, as one all-to-all: each rank cuts its
(W x S) rank-major gradient buffer into the W chunks its peers own,
quantizes each chunk bound for a peer in blocks of consecutive elements,
and sends it as one byte row (codes, then fp32 scales); each rank
dequantizes what its peers sent and sums it, in fp32 and in rank order,
with its *own* chunk, which never leaves the rank and is never quantized.
One quantization per gradient element, never a re-quantized partial sum
(a ring of quantized hops would round at every hop).

Error (Note [low-bit gradient error]): an element of the reduced chunk is off
the exact fp32 sum by at most sum over peers p of the format's
``error_bound(amax_p(block))`` (int8: ``amax / 254``; fp8 e4m3:
``amax / 28``; e5m2: ``amax / 14``), before the averaging divisor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import torch
import torch.distributed as dist

from flatfsdp.engine.comm import collectives
from flatfsdp.engine.comm.collectives import Pending
from flatfsdp.engine.comm.wire import PlainReduce
from flatfsdp.engine.layout.block_formats import BlockFormat, dequantize_flat, quantize_flat
from flatfsdp.engine.layout.device import SideStream
from flatfsdp.engine.layout.switches import Transport
from flatfsdp.engine.layout.views import same_start


def _round16(n: int) -> int:
    return -(-n // 16) * 16


def wire_bytes(size: int, fmt: BlockFormat) -> int:
    """Bytes of the row one peer receives for a chunk of ``size`` elements."""
    return _round16(_round16(size) + 4 * fmt.blocks(size))


@dataclass(frozen=True)
class BlockScaledReduce:
    """Reduce-scatters in a block-scaled format on any backend (point-to-point
    messages); all-reduces (replicas across HSDP's outer dimension, replicated
    groups) stay in fp32: they must end bitwise equal on every replica."""

    fmt: BlockFormat
    transport: Transport

    @property
    def key(self) -> Hashable:
        return ("blocks", self.fmt)

    def averages(self, divisor: float, group: dist.ProcessGroup, dtype: torch.dtype) -> bool:
        return False

    def reduce_scatter(self, output: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup, *,
                       async_op: bool, stream: SideStream | None, average: bool = False) -> Pending:
        """Chunk r of ``flat`` (fp32), summed over ranks, into rank r's ``output``;
        counted at the bytes of its codes."""
        world, me, size = group.size(), group.rank(), output.numel()
        row = wire_bytes(size, self.fmt)
        peers = [q for q in range(world) if q != me]
        sent = torch.empty(len(peers), row, dtype=torch.uint8, device=flat.device)
        received = torch.empty(len(peers), row, dtype=torch.uint8, device=flat.device)
        with torch.no_grad():
            for j, peer in enumerate(peers):
                codes, scales = self._parts(sent[j], size)
                quantize_flat(flat[peer * size:(peer + 1) * size], self.fmt, codes, scales)

        def finish() -> None:
            # own chunk first, then the peers in rank order: the same sum on every
            # run. Summed straight into ``output`` (fp32), a cache-sized piece at a
            # time: no whole-chunk temporaries.
            own = flat[me * size:(me + 1) * size]
            total = output if output.dtype == torch.float32 else torch.empty(size, dtype=torch.float32,
                                                                              device=output.device)
            if not same_start(own, total):
                total.copy_(own)
            for j in range(len(peers)):
                codes, scales = self._parts(received[j], size)
                dequantize_flat(codes, scales, self.fmt, total, accumulate=True)
            if total is not output:
                output.copy_(total)

        return collectives.exchange("reduce_scatter", world * row, [(p, sent[j]) for j, p in enumerate(peers)],
                                    [(p, received[j]) for j, p in enumerate(peers)], group, self.transport,
                                    then=[finish])

    def all_reduce(self, flat: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False,
                   stream: SideStream | None = None) -> Pending:
        return PlainReduce(self.transport).all_reduce(flat, group, async_op=async_op, stream=stream)

    def _parts(self, row: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        at = _round16(size)
        return row[:size], row[at:at + 4 * self.fmt.blocks(size)].view(torch.float32)
