"""Reduce-scatter of gradients as block-scaled int8 (``grad_reduce_dtype="int8"``).

ZeRO++'s quantized gradient reduction, as one all-to-all: each rank cuts its
(W x S) rank-major gradient buffer into the W chunks its peers own,
quantizes each chunk bound for a peer in blocks of consecutive elements,
and sends it as one byte row (codes, then fp32 scales); each rank
dequantizes what its peers sent and sums it, in fp32 and in rank order,
with its *own* chunk, which never leaves the rank and is never quantized.
One quantization per gradient element, never a re-quantized partial sum
(a ring of quantized hops would round at every hop).

Error (Note [low-bit gradient error]): an element of the reduced chunk is off
the exact fp32 sum by at most sum over peers p of ``amax_p(block) / 254``
(int8 rounds to the nearest of 254 steps of its block's range; fp8:
``amax / 28``), before the averaging divisor -- layout.lowbit.error_bound.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flatfsdp.engine.comm.exchange import post_messages
from flatfsdp.engine.layout.lowbit import LowBitFormat, dequantize_flat, quantize_flat
from flatfsdp.engine.layout.views import same_start


def _round16(n: int) -> int:
    return -(-n // 16) * 16


def wire_bytes(size: int, fmt: LowBitFormat) -> int:
    """Bytes of the row one peer receives for a chunk of ``size`` elements."""
    return _round16(_round16(size) + 4 * fmt.blocks(size))


def lowbit_reduce_scatter(output: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup,
                          fmt: LowBitFormat) -> tuple[list, list]:
    """Chunk r of ``flat`` (fp32), summed over ranks, into rank r's ``output``.
    Returns the posted works with their peers and the summation to run once
    they are done (see exchange.exchange_reduce_scatter)."""
    world, me, size = group.size(), group.rank(), output.numel()
    row = wire_bytes(size, fmt)
    peers = [q for q in range(world) if q != me]
    sent = torch.empty(len(peers), row, dtype=torch.uint8, device=flat.device)
    received = torch.empty(len(peers), row, dtype=torch.uint8, device=flat.device)
    with torch.no_grad():
        for j, peer in enumerate(peers):
            codes, scales = _parts(sent[j], size, fmt)
            quantize_flat(flat[peer * size:(peer + 1) * size], fmt, codes, scales)
    works = post_messages([(peer, sent[j]) for j, peer in enumerate(peers)],
                          [(peer, received[j]) for j, peer in enumerate(peers)], group)

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
            codes, scales = _parts(received[j], size, fmt)
            dequantize_flat(codes, scales, fmt, total, accumulate=True)
        if total is not output:
            output.copy_(total)

    return works, [finish]


def _parts(row: torch.Tensor, size: int, fmt: LowBitFormat) -> tuple[torch.Tensor, torch.Tensor]:
    at = _round16(size)
    return row[:size], row[at:at + 4 * fmt.blocks(size)].view(torch.float32)
