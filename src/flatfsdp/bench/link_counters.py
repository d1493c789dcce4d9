"""The bytes that crossed the throttled link during the timed steps, measured
two ways on the ranks themselves (docs/benchmarks.md, "Behind a slow link"):

* the interface's own counters (``/sys/class/net/<dev>/statistics``, which
  ``ip netns exec`` shows for the namespace the rank runs in): everything the
  link carried, headers, acknowledgements and native collectives included --
  exactly what its token bucket charged;
* the engine's account of the point-to-point messages it posted, per peer,
  split into peers on this rank's node and on the other node. Native
  collectives (gloo's all_reduce) are not in it: their routing is gloo's.

Which ranks share a node comes from torchrun's LOCAL_WORLD_SIZE (ranks are
numbered node-major), read once per run into a ``NodeLayout``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flatfsdp.bench.link_sampler import counter_path


@dataclass(frozen=True)
class NodeLayout:
    rank: int
    local_world_size: int
    """Ranks per node."""
    nodes: int

    @classmethod
    def from_env(cls, rank: int, world: int) -> "NodeLayout":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if local < 1 or world % local:
            raise RuntimeError(f"LOCAL_WORLD_SIZE={local} does not divide the world of {world} ranks")
        layout = cls(rank, local, world // local)
        group_rank = os.environ.get("GROUP_RANK")
        if group_rank is not None and int(group_rank) != layout.node:
            raise RuntimeError(f"rank {rank} runs on node {group_rank}, not {layout.node}: the intra/inter split "
                               "assumes torchrun's node-major rank numbering")
        return layout

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size


def split_sent(sent_by_peer: dict[int, int], layout: NodeLayout) -> tuple[int, int]:
    """(bytes sent to peers on this node, bytes sent to peers on other nodes)."""
    intra = sum(n for peer, n in sent_by_peer.items() if layout.node_of(peer) == layout.node)
    return intra, sum(sent_by_peer.values()) - intra


def read_counters(device: str) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of ``device`` in this process's network namespace."""
    return int(counter_path(device, "tx_bytes").read_text()), int(counter_path(device, "rx_bytes").read_text())


class LinkProbe:
    """Made on every rank right before the timed steps, ``finish`` right after
    them: both synchronise the ranks, so the counters hold exactly the timed
    steps' traffic (and two barriers' few bytes)."""

    def __init__(self, device: str, layout: NodeLayout, account, dev: torch.device) -> None:
        self.device, self.layout, self.account, self.dev = device, layout, account, dev
        # A node's ranks share its interface: one reader per node.
        self.reads = layout.rank % layout.local_world_size == 0
        # Between two barriers: no rank is still finishing warm-up traffic,
        # none has started the timed steps' yet.
        self.start = read_counters(device) if self.reads else (0, 0)
        dist.barrier()

    def finish(self, steps: int) -> dict:
        """Per-step bytes, summed over the ranks of each node (lists indexed by node)."""
        dist.barrier()  # every rank's last messages have landed
        n, node = self.layout.nodes, self.layout.node
        figures = torch.zeros(4 * n, dtype=torch.float64, device=self.dev)
        if self.reads:
            tx, rx = read_counters(self.device)
            figures[node], figures[n + node] = tx - self.start[0], rx - self.start[1]
        if self.account is not None:
            intra, inter = split_sent(self.account.sent_by_peer(), self.layout)
            figures[2 * n + node], figures[3 * n + node] = intra, inter
        dist.all_reduce(figures)
        per_step = (figures / steps).tolist()
        engine = self.account is not None
        return dict(device=self.device, nodes=n, iface_tx=per_step[:n], iface_rx=per_step[n:2 * n],
                    engine_intra=per_step[2 * n:3 * n] if engine else None,
                    engine_inter=per_step[3 * n:] if engine else None,
                    native_all_reduce=_native_all_reduce(self.account, steps) if engine else None)


def _native_all_reduce(account, steps: int) -> dict[str, float]:
    """Buffer bytes per step per mesh dimension of the engine's all-reduces, on
    this rank: gloo's own collective, whose per-peer traffic only the interface sees."""
    return {dim: kinds["all_reduce"]["bytes"] / steps for dim, kinds in account.by_dim().items()
            if "all_reduce" in kinds}
