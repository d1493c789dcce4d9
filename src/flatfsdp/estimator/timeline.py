"""A step's time, replayed from the engine's own schedule (schedule_trace.py).

One rank's records are walked in order. Compute ops advance the host's clock
by what the compute model says they cost. A collective starts on its tier's
link when it is issued -- or, a chained stage, once the stage it follows has
landed -- and after whatever is already queued on that link (messages
between two ranks leave in the order posted: one FIFO per tier). A wait
holds the clock until the collectives it names have landed; that hold is
the communication left exposed, booked to the tier of the last to land.
Where moving bytes costs the host CPU (gloo on a shared host), the fabric
says how much, and the clock pays it where the engine issues the collective.

Every rank runs the same schedule (SPMD), so rank 0's replay is the step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

from flatfsdp.engine import schedule_log
from flatfsdp.estimator.schedule_trace import Op, StepTrace


class ComputeModel(Protocol):
    step_overhead_s: float
    """Host time a step costs beyond its ops (the model's Python), paid once."""

    def seconds(self, op: Op) -> float: ...
    def describe(self) -> str: ...


class Fabric(Protocol):
    def tier(self, record: schedule_log.Issued) -> str:
        """Which link a collective crosses ("intra", "inter", "link", ...)."""

    def wire_seconds(self, record: schedule_log.Issued, nbytes: int) -> float:
        """How long ``nbytes`` of collective ``record`` occupy its tier's link."""

    def host_seconds(self, record: schedule_log.Issued, nbytes: int) -> float:
        """CPU the host spends moving those bytes, taken from compute (0 on devices)."""

    def describe(self) -> str: ...


@dataclass
class Prediction:
    """A predicted step of one rank."""
    step_s: float = 0.0
    compute_s: float = 0.0
    """The compute ops alone, back to back."""
    by_phase: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Compute seconds by phase: forward, backward, optimizer, engine."""
    host_comm_s: float = 0.0
    """Host CPU paid for moving bytes (CPU hosts)."""
    exposed: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Seconds the host waited for collectives, by tier: communication not hidden."""
    busy: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Seconds each tier's link carried bytes."""
    model_flops: int = 0

    @property
    def tflops(self) -> float:
        """Model TFLOP/s per rank (forward + backward FLOPs over the step)."""
        return self.model_flops / self.step_s / 1e12 if self.step_s > 0 else 0.0

    def to_json(self) -> dict:
        return dict(step_s=self.step_s, compute_s=self.compute_s, by_phase=dict(self.by_phase),
                    host_comm_s=self.host_comm_s, exposed=dict(self.exposed), busy=dict(self.busy),
                    model_flops=self.model_flops, tflops=self.tflops)


@dataclass
class _Collective:
    record: schedule_log.Issued
    tier: str
    done: float = 0.0
    after: tuple[int, ...] = ()


def replay(trace: StepTrace, compute: ComputeModel, fabric: Fabric) -> Prediction:
    """The step ``trace`` records, timed by ``compute`` and ``fabric``."""
    follows = {t: r.after for r in trace.records if isinstance(r, schedule_log.Follows) for t in r.tickets}
    out = Prediction(model_flops=trace.flops())
    clock = out.compute_s = compute.step_overhead_s
    out.by_phase["framework"] = clock
    link_free: dict[str, float] = defaultdict(float)
    flights: dict[int, _Collective] = {}

    def send(c: _Collective, nbytes: int, now: float) -> float:
        """Queue ``nbytes`` of ``c`` on its link; returns the host CPU it costs."""
        start = max([now, link_free[c.tier]] + [flights[t].done for t in c.after if t in flights])
        took = fabric.wire_seconds(c.record, nbytes)
        link_free[c.tier] = c.done = max(c.done, start + took)
        out.busy[c.tier] += took
        return fabric.host_seconds(c.record, nbytes)

    for record in trace.records:
        if isinstance(record, Op):
            took = compute.seconds(record)
            clock += took
            out.compute_s += took
            out.by_phase[record.phase] += took
        elif isinstance(record, schedule_log.Issued):
            c = flights[record.ticket] = _Collective(record, fabric.tier(record), after=follows.get(record.ticket, ()))
            if not record.paced:
                host = send(c, record.nbytes, clock)
                clock += host
                out.host_comm_s += host
        elif isinstance(record, schedule_log.Posted) and record.ticket in flights:
            host = send(flights[record.ticket], record.nbytes, clock)
            clock += host
            out.host_comm_s += host
        elif isinstance(record, schedule_log.Waited):
            landing = [flights[t] for t in record.tickets if t in flights]
            if landing:
                last = max(landing, key=lambda c: c.done)
                if last.done > clock:
                    out.exposed[last.tier] += last.done - clock
                    clock = last.done
    # What is still in flight when the step's last op ends is waited for by the next step's first use.
    end = max([clock] + [c.done for c in flights.values()])
    out.step_s = end
    return out
