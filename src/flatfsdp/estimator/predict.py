"""Time for the estimator's rows: each layout's recorded step (rank_step.measure
with ``trace``) replayed on a compute model and the links of a cluster of
that layout's size (timeline.py), and the layout to pick at each world size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from flatfsdp.estimator.compute_cost import Measured
from flatfsdp.estimator.fabric import PRESETS, Cluster, Host, Link, Mesh, gbit
from flatfsdp.estimator.probe import MachineProbe, loopback
from flatfsdp.estimator.rank_step import Layout, RankFigures
from flatfsdp.estimator.timeline import ComputeModel, Prediction, replay


def mesh_dims(layout: Layout) -> dict[str, tuple[int, int]]:
    """The mesh rank_step.make_mesh builds, as (size, stride) per dimension: row-major
    (dp_outer, dp_shard, tp)."""
    dims = {"dp_shard": (layout.shard, layout.tp), "world": (layout.world, 1)}
    if layout.replicas > 1:
        dims["dp_outer"] = (layout.replicas, layout.shard * layout.tp)
    if layout.tp > 1:
        dims["tp"] = (layout.tp, 1)
    return dims


def parse_link(text: str) -> Link:
    """A preset's name (``fabric.PRESETS``) or a rate in tc's units ("2gbit", "400gbit")."""
    if text in PRESETS:
        return PRESETS[text]
    from flatfsdp.bench.wire import parse_rate

    try:
        return Link(parse_rate(text) / 1e9, 0.0, text)
    except SystemExit:
        raise ValueError(f"link {text!r}: a preset ({', '.join(PRESETS)}) or a rate such as 2gbit") from None


@dataclass(frozen=True)
class Links:
    """How a cluster's ranks are joined: ``ranks_per_node`` on ``intra``,
    nodes on ``inter``; or, ``host`` given, CPU ranks on this machine as probed."""
    intra: Link = PRESETS["nvlink-h100"]
    inter: Link = PRESETS["ib-400"]
    ranks_per_node: int = 8
    host: Host | None = None
    probed_ranks: int = 1
    """With ``host``: the ranks the probe ran side by side (ranks beyond them share its cores)."""

    def fabric(self, layout: Layout):
        mesh = Mesh(self.ranks_per_node, mesh_dims(layout))
        if self.host is not None:
            return replace(self.host, mesh=mesh, slowdown=max(1.0, layout.world / max(1, self.probed_ranks)))
        return Cluster(self.intra, self.inter, mesh)


def time_rows(rows: list[tuple[Layout, RankFigures]], compute: Callable[[Layout], ComputeModel],
              links: Links) -> list[Prediction]:
    """Each row's predicted step (rows estimated with a recorded schedule);
    ``compute(layout)``: the compute model of a rank of that layout."""
    out = []
    for layout, figures in rows:
        if figures.schedule is None:
            raise ValueError("the rows were estimated without their schedule: estimate(..., trace=True)")
        out.append(replay(figures.schedule, compute(layout), links.fabric(layout)))
    return out


def probed(machine: MachineProbe, cluster: Links | None = None) -> tuple[Callable[[Layout], ComputeModel], Links]:
    """A probe's compute and links. A probe of a host's CPU: every rank of a
    layout runs on the probed machine -- alone at world 1, else side by side,
    slowed where they outnumber the ranks the probe ran (its cores), joined by
    the loopback it measured. A probe of an accelerator (its ops timed on the
    device): every rank is such a device, computing as the probed one did,
    joined by ``cluster`` (a one-device probe measures no link)."""
    if machine.alone.overlapped:
        def on_device(layout: Layout) -> ComputeModel:
            return Measured(machine.alone, source="probe of this machine's accelerator")
        return on_device, cluster or Links()

    def slowdown(layout: Layout) -> float:
        return max(1.0, layout.world / machine.ranks)

    def compute(layout: Layout) -> ComputeModel:
        if layout.world == 1:
            return Measured(machine.alone, source="probe of this machine")
        return Measured(machine.side_by_side, slowdown(layout), source="probe of this machine")

    host = Host(loopback(machine), machine.cpu_s_per_byte, Mesh(1), loopback_busy=loopback(machine, True),
                sum_s_per_byte=machine.sum_s_per_byte)
    return compute, Links(ranks_per_node=1 << 30, host=host, probed_ranks=machine.ranks)


def recommend(rows: list[tuple[Layout, RankFigures]], predictions: list[Prediction],
              capacity_bytes: float | None) -> dict[int, int]:
    """Per world size, the index of the fastest row whose peak fits ``capacity_bytes``
    (None: any); a world size where nothing fits has no entry."""
    best: dict[int, int] = {}
    for index, ((layout, figures), prediction) in enumerate(zip(rows, predictions)):
        if capacity_bytes is not None and figures.peak > capacity_bytes:
            continue
        current = best.get(layout.world)
        if current is None or prediction.step_s < predictions[current].step_s:
            best[layout.world] = index
    return best


__all__ = ["Links", "gbit", "mesh_dims", "parse_link", "probed", "recommend", "time_rows"]
