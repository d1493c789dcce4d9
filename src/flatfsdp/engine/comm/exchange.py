"""All-gather and reduce-scatter as direct pairwise exchanges (send/recv).

Used on gloo, where they beat gloo's own collectives on the same buffers (see
Note [gloo exchange]); NCCL's collectives are used as they are.

Both move the minimum: each rank sends every peer exactly the chunk that peer
needs, once, and receives what it needs from each peer, once -- (world - 1)
chunks each way, the volume of a ring collective. All sends and receives are
posted at once, so no ordering between ranks can deadlock, and they progress
on gloo's transport threads while the caller computes.
"""

from __future__ import annotations

import itertools
from typing import Callable

import torch
import torch.distributed as dist

from flatfsdp.engine.comm.comm_account import comm_account
from flatfsdp.engine.layout.views import same_start

_TAG_SPACE = 1 << 20
_tags: dict[int, itertools.count] = {}


def _next_tag(group: dist.ProcessGroup) -> int:
    # Every rank issues the same exchanges in the same order, so a per-group
    # counter gives matching sends and receives the same tag on both sides;
    # distinct tags keep two exchanges in flight between a pair apart.
    counter = _tags.setdefault(id(group), itertools.count())
    return next(counter) % _TAG_SPACE


def _chunk(flat: torch.Tensor, index: int, size: int) -> torch.Tensor:
    return flat[index * size:(index + 1) * size]


def post_messages(sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]],
                  group: dist.ProcessGroup) -> list[tuple[dist.Work, int]]:
    """Post every send and receive at once, under one tag. Several messages
    between the same pair are matched in the order posted (gloo keeps them in
    order per pair and tag), so both sides must list them in the same order --
    which they do, building the lists from the same layout. Returns each work
    with its peer (a wait that times out then names the rank that is missing)."""
    tag, works = _next_tag(group), []
    for peer, tensor in sends:
        works.append((dist.isend(tensor, group=group, group_dst=peer, tag=tag), peer))
        comm_account().add_sent(dist.get_global_rank(group, peer), tensor.numel() * tensor.element_size())
    for peer, tensor in recvs:
        works.append((dist.irecv(tensor, group=group, group_src=peer, tag=tag), peer))
    return works


def exchange_all_gather(output: torch.Tensor, shard: torch.Tensor,
                        group: dist.ProcessGroup) -> list[tuple[dist.Work, int]]:
    """Rank r's ``shard`` lands in chunk r of every rank's ``output``."""
    world, me, size = group.size(), group.rank(), shard.numel()
    mine = _chunk(output, me, size)
    if not same_start(mine, shard):
        mine.copy_(shard)
    peers = [peer for peer in range(world) if peer != me]
    return post_messages([(peer, mine) for peer in peers], [(peer, _chunk(output, peer, size)) for peer in peers],
                         group)


def exchange_reduce_scatter(output: torch.Tensor, flat: torch.Tensor,
                            group: dist.ProcessGroup) -> tuple[list[tuple[dist.Work, int]], list[Callable[[], None]]]:
    """Chunk r of ``flat``, summed over ranks, lands in rank r's ``output``.

    Returns the works with their peers and (as a one-item list) the summation to run once they are done. The peers'
    contributions arrive in a scratch buffer of (world - 1) chunks; the sum
    runs in rank order, so it is the same whichever rank computes it.
    """
    world, me, size = group.size(), group.rank(), output.numel()
    received = torch.empty((world - 1) * size, dtype=flat.dtype, device=flat.device)
    tag, works, slots = _next_tag(group), [], {}
    for peer in range(world):
        if peer == me:
            continue
        slots[peer] = _chunk(received, len(slots), size)
        works.append((dist.isend(_chunk(flat, peer, size), group=group, group_dst=peer, tag=tag), peer))
        comm_account().add_sent(dist.get_global_rank(group, peer), size * flat.element_size())
        works.append((dist.irecv(slots[peer], group=group, group_src=peer, tag=tag), peer))

    def finish() -> None:
        parts = [slots.get(rank, _chunk(flat, me, size)) for rank in range(world)]
        if any(same_start(part, output) for part in parts[1:]):
            # ``output`` is this rank's own chunk of ``flat`` (a kept gradient
            # buffer reduced in place) and a later term: sum aside, then store.
            total = parts[0].clone()
            for part in parts[1:]:
                total.add_(part)
            output.copy_(total)
            return
        if not same_start(output, parts[0]):
            output.copy_(parts[0])
        for part in parts[1:]:
            output.add_(part)

    return works, [finish]


# Note [gloo exchange]
# Measured on this 2-core host, 2 ranks, 128 MB fp32 buffers (median of 5):
# gloo all_gather_single 137 ms, reduce_scatter_single 177 ms, all_reduce
# 98 ms; one send/recv exchange of the 64 MB halves 67-68 ms, plus the add
# for the reduction. gloo's collectives pipeline through extra copies and
# rounds; a direct exchange is one transfer each way, so on gloo the engine
# gathers and reduce-scatters this way. FLATFSDP_GLOO_ALGORITHM selects
# "exchange" (default), "native" (gloo's own collectives) or "all_reduce"
# (gradients all-reduced in place, each rank keeping its slice).
