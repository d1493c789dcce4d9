"""Links between ranks, as the time model (timeline.py) asks about them:
which link a collective crosses, how long its bytes occupy it, and what
moving them costs the host's CPU.

Two kinds:

* ``Cluster``: accelerators, NCCL-style rings. Inside a node the ranks share
  a fast fabric (NVLink); a group that spans nodes runs at the slower of
  that and each rank's own network port. A ring of g ranks moves
  (g - 1) / g of the buffer per rank (twice for an all-reduce) and pays a
  latency per step. Named presets: ``PRESETS``.
* ``Host``: CPU ranks on one host, moving bytes over loopback with gloo
  (what a probe measured: rate, latency, CPU per byte), optionally behind
  the bench's throttled links -- one token bucket every rank's traffic
  shares (``--link RATE``), or two simulated nodes whose egress is throttled
  (``--nnodes 2``).

Which mesh dimension spans nodes follows from the mesh's shape: ``dims``
maps a dimension's name to (size, stride in ranks); a group whose members lie
further apart than a node's ranks spans nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flatfsdp.engine import schedule_log


@dataclass(frozen=True)
class Link:
    gbytes_s: float
    """Bandwidth per rank and direction, GB/s (10^9 bytes)."""
    latency_s: float
    """Per ring step (Cluster) or per collective (Host)."""
    name: str = ""


@dataclass(frozen=True)
class Mesh:
    """Ranks, their nodes and the mesh dimensions' shapes."""
    ranks_per_node: int
    dims: dict[str, tuple[int, int]] = field(default_factory=dict)
    """name -> (size, stride): members are ``stride`` ranks apart."""

    def shape_of(self, record: schedule_log.Issued) -> tuple[int, int]:
        return self.dims.get(record.dim, (record.group_size, 1))

    def spans_nodes(self, record: schedule_log.Issued) -> bool:
        size, stride = self.shape_of(record)
        return size > 1 and size * stride > self.ranks_per_node

    def members_per_node(self, record: schedule_log.Issued) -> int:
        size, stride = self.shape_of(record)
        return max(1, min(size, self.ranks_per_node // stride))


def ring_bytes(record: schedule_log.Issued, nbytes: int) -> float:
    """Bytes each rank sends for ``nbytes`` of the collective's buffer."""
    g = record.group_size
    if g <= 1:
        return 0.0
    return (2 if record.kind == "all_reduce" else 1) * (g - 1) / g * nbytes


@dataclass(frozen=True)
class Cluster:
    intra: Link
    inter: Link
    mesh: Mesh

    def tier(self, record: schedule_log.Issued) -> str:
        return "inter" if self.mesh.spans_nodes(record) else "intra"

    def wire_seconds(self, record: schedule_log.Issued, nbytes: int, busy: bool = True) -> float:
        g = record.group_size
        if g <= 1:
            return 0.0
        across = self.tier(record) == "inter"
        gbytes_s = min(self.intra.gbytes_s, self.inter.gbytes_s) if across else self.intra.gbytes_s
        latency = self.inter.latency_s if across else self.intra.latency_s
        return (g - 1) * latency + ring_bytes(record, nbytes) / (gbytes_s * 1e9)

    def host_seconds(self, record: schedule_log.Issued, nbytes: int) -> float:
        return 0.0  # DMA engines and the NIC move the bytes

    def stolen(self, record: schedule_log.Issued, nbytes: int) -> float:
        return 0.0

    def describe(self) -> str:
        return (f"links: {self.intra.name} {self.intra.gbytes_s:g} GB/s inside a node of {self.mesh.ranks_per_node}, "
                f"{self.inter.name} {self.inter.gbytes_s:g} GB/s per rank between nodes; rings, "
                f"{self.intra.latency_s * 1e6:g} / {self.inter.latency_s * 1e6:g} us a step")


@dataclass(frozen=True)
class Host:
    """CPU ranks on one host (see the module docstring)."""
    loopback: Link
    """Loopback while the ranks wait: nothing competes with gloo's threads."""
    cpu_s_per_byte: dict[str, float]
    """Compute time a rank loses per byte it sends while it computes beside the
    transfer, by collective kind (sending and receiving both paid), as the
    probe measured."""
    mesh: Mesh
    shared_rate: float | None = None
    """Bytes/s of one token bucket all ranks' traffic shares (``--link``, one node)."""
    node_rate: float | None = None
    """Bytes/s of each node's egress (``--link`` with ``--nnodes 2``)."""
    link_rate_busy: float | None = None
    """Bytes/s the throttled link (shared or between nodes) carries while the
    ranks compute, where a probe of the link measured it; None: as while they
    wait (``shared_rate``/``node_rate``)."""
    slowdown: float = 1.0
    """Ranks sharing the cores beyond one a core: CPU work takes this much longer."""
    loopback_busy: Link | None = None
    """Loopback while the ranks compute (gloo's threads then share the cores);
    None: as while they wait."""
    sum_s_per_byte: float = 0.0
    """A reduce-scatter's sum of what arrived, on the host's main thread, per byte received."""

    def tier(self, record: schedule_log.Issued) -> str:
        if self.node_rate is not None and self.mesh.spans_nodes(record):
            return "inter"
        return "link" if self.shared_rate is not None else "loopback"

    def wire_seconds(self, record: schedule_log.Issued, nbytes: int, busy: bool = True) -> float:
        sent = ring_bytes(record, nbytes)
        if sent == 0:
            return 0.0
        loop = self.loopback_busy if busy and self.loopback_busy is not None else self.loopback
        took = (loop.latency_s + sent / (loop.gbytes_s * 1e9)) * self.slowdown
        throttled = self.link_bytes(record, nbytes)
        if throttled:
            rate = self.link_rate_busy if busy and self.link_rate_busy else (self.shared_rate or self.node_rate)
            took = max(took, self.loopback.latency_s + throttled / rate)
        return took

    def link_bytes(self, record: schedule_log.Issued, nbytes: int) -> float:
        """Bytes of ``nbytes`` of collective ``record`` that cross the throttled
        link (0 when none does): all ranks' through the one shared bucket, or
        what one node's egress carries."""
        sent = ring_bytes(record, nbytes)
        if self.shared_rate is not None:
            return record.group_size * sent
        if self.node_rate is not None and self.mesh.spans_nodes(record):
            # Every rank of a node runs the same collective over its own group (SPMD):
            # the node's egress carries each one's bytes to members on other nodes.
            g, here = record.group_size, self.mesh.members_per_node(record)
            return self.mesh.ranks_per_node * sent * (g - here) / (g - 1)
        return 0.0

    def host_seconds(self, record: schedule_log.Issued, nbytes: int) -> float:
        summed = record.kind == "reduce_scatter"
        return self.sum_s_per_byte * ring_bytes(record, nbytes) * self.slowdown if summed else 0.0

    def stolen(self, record: schedule_log.Issued, nbytes: int) -> float:
        """Compute lost per byte x bytes per second the transfer moves while the host computes."""
        took = self.wire_seconds(record, nbytes, busy=True)
        per_byte = self.cpu_s_per_byte.get(record.kind, self.cpu_s_per_byte.get("all_gather", 0.0))
        return per_byte * ring_bytes(record, nbytes) / took if took > 0 else 0.0

    def describe(self) -> str:
        busy = self.loopback_busy or self.loopback
        text = (f"links: loopback {self.loopback.gbytes_s:.2f} GB/s per rank waiting, {busy.gbytes_s:.2f} computing, "
                f"{self.loopback.latency_s * 1e3:.2f} ms a collective; compute lost moving bytes "
                + ", ".join(f"{k} {v * 1e9:.2f} s/GB" for k, v in self.cpu_s_per_byte.items()))
        if self.slowdown != 1:
            text += f"; x{self.slowdown:.2f} for ranks sharing the cores"
        busy_rate = f" ({self.link_rate_busy / 1e6:.0f} computing)" if self.link_rate_busy else ""
        if self.shared_rate is not None:
            text += f"; behind one link of {self.shared_rate / 1e6:.0f} MB/s{busy_rate} shared by every rank"
        if self.node_rate is not None:
            text += (f"; nodes of {self.mesh.ranks_per_node} joined by {self.node_rate / 1e6:.0f} MB/s{busy_rate} "
                     "each way")
        return text


def gbit(rate: float) -> float:
    """Gbit/s -> GB/s."""
    return rate / 8


PRESETS = {
    # NVLink 4 (H100 SXM): 900 GB/s per GPU both directions together, 450 each way
    # (NVIDIA H100 datasheet); assumed 80% reachable by a ring collective: 360 GB/s.
    "nvlink-h100": Link(360.0, 2e-6, "NVLink 4"),
    # 400 Gbit/s InfiniBand NDR, one port per GPU (ConnectX-7): 50 GB/s; assumed 90%.
    "ib-400": Link(gbit(400) * 0.9, 5e-6, "InfiniBand 400 Gbit/s"),
    # 200 Gbit/s (HDR) and 100 Gbit/s Ethernet/RoCE, one port per GPU; assumed 90%.
    "ib-200": Link(gbit(200) * 0.9, 5e-6, "InfiniBand 200 Gbit/s"),
    "eth-100": Link(gbit(100) * 0.9, 10e-6, "Ethernet 100 Gbit/s"),
}
"""Links by name. Bandwidths are per GPU and direction; the efficiencies and
latencies are assumptions, printed with every prediction."""
