"""Coalescing: many small collectives become one.

Every collective pays a fixed latency (about 0.6-0.9 ms on gloo here, whatever
the size below ~64 KB), so a model of many small units, or a unit with several
small param groups (frozen and trainable, two dtypes), would spend its time on
latency. Requests smaller than the bucket size are packed into one staging
buffer per bucket and sent as one collective, then copied out; requests at or
above it go as they are, straight into the buffers parameters view (zero copy).
The copy is the price of coalescing and is paid only by buffers small enough
that it costs less than the latency it saves.

Gathers pack bytes (dtypes may mix: nothing is summed) and copy each member's
chunks into place; reductions pack per dtype, rank-major for a reduce-scatter
so each rank's slice stays contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from flatfsdp.engine.comm import collectives
from flatfsdp.engine.comm.collectives import Pending
from flatfsdp.engine.comm.wire import GatherCodec, ReduceCodec
from flatfsdp.engine.layout.device import SideStream
from flatfsdp.engine.layout.options import DEFAULT_BUCKET_BYTES  # noqa: F401  (its home; re-exported for callers)


@dataclass
class GatherRequest:
    """Gather one group's weights (its ``codec``) over ``group``; run ``then`` once landed."""

    codec: GatherCodec
    group: dist.ProcessGroup
    then: list[Callable[[], None]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.codec.nbytes


def gather(requests: list[GatherRequest], *, async_op: bool, bucket_bytes: int,
           stream: SideStream | None = None) -> list[Pending]:
    """Issue every request; return one Pending per request (bucket members share one)."""
    out: list[Pending | None] = [None] * len(requests)
    for i, request in enumerate(requests):
        pending = request.codec.local_result()  # rows already here: nothing travels
        if pending is None and request.codec.travels_alone:
            pending = request.codec.issue_alone(request.group, async_op=async_op, stream=stream)
        if pending is not None:
            pending.then.extend(request.then)
            out[i] = pending
    remote = [i for i, p in enumerate(out) if p is None]
    for bucket in _buckets([requests[i] for i in remote], bucket_bytes, key=lambda r: id(r.group)):
        bucket = [remote[i] for i in bucket]
        pending = _gather_bucket([requests[i] for i in bucket], async_op, stream)
        for i in bucket:
            out[i] = pending
    return out  # type: ignore[return-value]


def _gather_bucket(members: list[GatherRequest], async_op: bool, stream: SideStream | None) -> Pending:
    if len(members) == 1:
        only = members[0]
        pending = only.codec.issue_alone(only.group, async_op=async_op, stream=stream)
        if pending is not None:
            pending.then.extend(only.then)
            return pending
    # One byte row per rank holding every member's row back to back; each
    # member's part of the gathered rows is unpacked into place.
    group, world, rank = members[0].group, members[0].group.size(), members[0].group.rank()
    sizes = [m.codec.row_bytes for m in members]
    total, offsets = sum(sizes), _offsets(sizes)
    device = members[0].codec.device
    packed = torch.empty(world, total, dtype=torch.uint8, device=device)
    for m, off, size in zip(members, offsets, sizes):
        m.codec.pack(packed[rank, off:off + size])
    pending = collectives.all_gather(packed.view(-1), packed[rank], group, members[0].codec.transport, async_op,
                                     stream)

    def unpack() -> None:
        for m, off, size in zip(members, offsets, sizes):
            m.codec.unpack(packed[:, off:off + size])
            for callback in m.then:
                callback()
    pending.then.append(unpack)
    return pending


@dataclass
class ReduceRequest:
    """Sum ``flat`` over ``group``: all of it in place ("all_reduce"), or this
    rank's slice into ``output`` ("reduce_scatter"), as ``codec`` moves bytes.
    ``then`` runs once landed."""

    kind: str
    flat: torch.Tensor
    output: torch.Tensor
    group: dist.ProcessGroup
    codec: ReduceCodec
    then: list[Callable[[], None]] = field(default_factory=list)
    pending: Pending | None = None
    """Set when issued; until then a ``ReductionQueue`` may hold it in a bucket."""
    flush: Callable[[], None] | None = None
    """Issues the bucket holding this request (set by the queue that holds it)."""
    unit: str = ""
    """The unit whose gradients these are (named if the reduction times out)."""
    outer: dist.ProcessGroup | None = None
    """HSDP: once summed over ``group``, ``output`` is all-reduced over this
    group too (the replicas'), before ``then``."""
    average: bool = False
    """The codec's collective averages (FSDP2's ``ReduceOp.AVG``; wire.ReduceCodec.averages)."""
    follow: Callable[[], Pending] | None = None
    """A collective to issue once ``output`` has landed (HFSDP's reduce-scatter
    across the outer dimension), before ``then``; chained, never blocking."""
    landed: list[Callable[[], None]] = field(default_factory=list)
    """Run once ``output`` has landed, before any follow-up (release the
    unsharded gradient buffer while the follow-up travels)."""
    drain: Callable[[], None] | None = None
    """Waits, in order, for the reductions issued before this one (set by
    the queue that issued it: chained follow-ups must start in the same
    order on every rank)."""

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    @property
    def bucket_key(self) -> tuple:
        """Requests with equal keys may share one collective."""
        return (id(self.group), id(self.outer), self.kind, self.flat.dtype, self.codec.key, self.average)

    def wait(self) -> None:
        if self.pending is None and self.flush is not None:
            self.flush()
        if self.drain is not None:
            self.drain()
        if self.pending is not None:
            self.pending.wait()


def reduce(members: list[ReduceRequest], *, async_op: bool, stream: SideStream | None = None) -> Pending:
    """One collective for requests of one bucket key; then, chained (see
    Pending.chain), with replicas one all-reduce across them for the whole
    bucket, and each member's own follow-up."""
    outer, codec, unpack = members[0].outer, members[0].codec, None
    if len(members) == 1:
        only = members[0]
        target = only.flat if only.kind == "all_reduce" else only.output
        if only.kind == "all_reduce":
            pending = codec.all_reduce(only.flat, only.group, async_op=async_op, stream=stream)
        else:
            pending = codec.reduce_scatter(only.output, only.flat, only.group, async_op=async_op, stream=stream,
                                           average=only.average)
    elif members[0].kind == "all_reduce":
        pending, target, unpack = _all_reduce_packed(members, async_op, stream)
    else:
        pending, target, unpack = _reduce_scatter_packed(members, async_op, stream)
    if members[0].kind == "reduce_scatter":  # the inputs are spent once the first stage lands
        pending.then.extend(callback for m in members for callback in m.landed)
    if outer is not None:
        pending.chain(lambda: codec.all_reduce(target, outer, async_op=True, stream=stream))
    if unpack is not None:
        pending.then.append(unpack)
    follows = [m.follow for m in members if m.follow is not None]
    if follows:
        pending.chain(lambda: Pending.joined([follow() for follow in follows]))
    for m in members:
        m.pending = pending
        pending.then.extend(m.then)
    units = ", ".join(dict.fromkeys(f"'{m.unit}'" for m in members))
    pending.label = f"unit {units}: gradient reduction {pending.label}"
    return pending


def _all_reduce_packed(members: list[ReduceRequest], async_op: bool,
                       stream: SideStream | None) -> tuple[Pending, torch.Tensor, Callable[[], None]]:
    codec = members[0].codec
    packed = torch.cat([m.flat.reshape(-1) for m in members])
    pending = codec.all_reduce(packed, members[0].group, async_op=async_op, stream=stream)
    offsets = _offsets([m.flat.numel() for m in members])

    def unpack() -> None:
        for m, off in zip(members, offsets):
            m.flat.view(-1).copy_(packed[off:off + m.flat.numel()])
    return pending, packed, unpack


def _reduce_scatter_packed(members: list[ReduceRequest], async_op: bool,
                           stream: SideStream | None) -> tuple[Pending, torch.Tensor, Callable[[], None]]:
    codec = members[0].codec
    group, world = members[0].group, members[0].group.size()
    sizes = [m.output.numel() for m in members]
    total, offsets = sum(sizes), _offsets(sizes)
    first = members[0].flat
    packed = torch.empty(world * total, dtype=first.dtype, device=first.device)
    by_rank = packed.view(world, total)
    for m, off, size in zip(members, offsets, sizes):
        by_rank[:, off:off + size].copy_(m.flat.view(world, size))
    result = torch.empty(total, dtype=first.dtype, device=first.device)
    pending = codec.reduce_scatter(result, packed, group, async_op=async_op, stream=stream,
                                   average=members[0].average)

    def unpack() -> None:
        for m, off, size in zip(members, offsets, sizes):
            m.output.copy_(result[off:off + size])
    return pending, result, unpack


def _offsets(sizes: list[int]) -> list[int]:
    offsets, running = [], 0
    for size in sizes:
        offsets.append(running)
        running += size
    return offsets


def _buckets(requests: list, bucket_bytes: int, key: Callable) -> list[list[int]]:
    """Indices of ``requests`` grouped into buckets, in request order: a request
    of at least ``bucket_bytes`` alone; smaller ones with the same key together
    while their total stays within ``bucket_bytes``."""
    buckets: list[list[int]] = []
    open_: dict = {}
    for i, request in enumerate(requests):
        if request.nbytes >= bucket_bytes:
            buckets.append([i])
            continue
        k = key(request)
        bucket = open_.get(k)
        if bucket is None or sum(requests[j].nbytes for j in bucket) + request.nbytes > bucket_bytes:
            bucket = open_[k] = []
            buckets.append(bucket)
        bucket.append(i)
    return buckets
