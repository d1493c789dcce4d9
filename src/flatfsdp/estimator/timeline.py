"""A step's time, replayed from the engine's own schedule (schedule_trace.py).

One rank's records are walked in order. Compute ops advance the host's clock
by what the compute model says they cost. A collective joins its tier's link
when it is issued, behind whatever that link still carries (messages between
two ranks leave in the order posted: one FIFO per tier); a chained stage
(HSDP's all-reduce after a reduce-scatter) also waits for the stage it
follows to land. A wait holds the clock until the collectives it names have
landed; that hold is the communication left exposed, booked to the tier of
the last to land.

Links move bytes at a rate that may depend on what the host does
(``Fabric.wire_seconds(..., busy)``): on a CPU host gloo's threads share the
cores with compute, so a transfer runs slower while the host computes than
while it waits, and compute runs slower while a transfer moves
(``Fabric.stolen``). The replay is fluid: each link's first collective
progresses at the rate of the moment, and the host's compute at the speed
the transfers moving then leave it.

Every rank runs the same schedule (SPMD), so rank 0's replay is the step.
"""

from __future__ import annotations

from collections import defaultdict, deque
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

    def wire_seconds(self, record: schedule_log.Issued, nbytes: int, busy: bool) -> float:
        """How long ``nbytes`` of collective ``record`` occupy its link, the host
        computing (``busy``) or waiting the whole time."""

    def host_seconds(self, record: schedule_log.Issued, nbytes: int) -> float:
        """Host work a collective adds to the compute thread once (a gloo
        reduction's sum of what arrived; 0 on devices)."""

    def stolen(self, record: schedule_log.Issued, nbytes: int) -> float:
        """The share of the host's compute speed this transfer takes while both
        run (gloo's threads on a CPU host's cores; 0 on devices)."""

    def describe(self) -> str: ...


MAX_STOLEN = 0.95
"""Transfers never stop compute altogether (the scheduler still runs it)."""


@dataclass
class Prediction:
    """A predicted step of one rank."""
    step_s: float = 0.0
    compute_s: float = 0.0
    """The compute ops alone, back to back (and the model's fixed cost a step)."""
    by_phase: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Compute seconds by phase: forward, backward, optimizer, engine, framework."""
    host_comm_s: float = 0.0
    """Wall time the host's compute lost to moving bytes (CPU hosts): transfers
    sharing its cores, a reduction's sum."""
    exposed: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Seconds the host waited for collectives, by tier: communication not hidden."""
    busy: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Seconds each tier's link carried bytes."""
    waits: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Exposed seconds by what the host waited for: "all_gather 49.2 MB over world, issued in
    flatfsdp::unshard (<root>)" -- where the schedule loses time."""
    model_flops: int = 0

    @property
    def tflops(self) -> float:
        """Model TFLOP/s per rank (``StepTrace.model_flops`` over the step)."""
        return self.model_flops / self.step_s / 1e12 if self.step_s > 0 else 0.0

    def to_json(self) -> dict:
        return dict(step_s=self.step_s, compute_s=self.compute_s, by_phase=dict(self.by_phase),
                    host_comm_s=self.host_comm_s, exposed=dict(self.exposed), busy=dict(self.busy),
                    waits=dict(sorted(self.waits.items(), key=lambda kv: -kv[1])), model_flops=self.model_flops,
                    tflops=self.tflops)


@dataclass(eq=False)
class _Transfer:
    """Bytes of one collective (a paced one's slice) queued on a link."""
    record: schedule_log.Issued
    nbytes: int
    after: tuple[int, ...]
    left: float = 1.0
    """Fraction still to move."""


class _Links:
    """Every tier's FIFO of transfers, advanced together through time."""

    def __init__(self, fabric: Fabric, out: Prediction):
        self.fabric, self.out = fabric, out
        self.queues: dict[str, deque[_Transfer]] = defaultdict(deque)
        self.done: dict[int, float] = {}
        """Ticket -> when its last transfer landed (while none is queued)."""
        self.queued: dict[int, int] = defaultdict(int)

    def enqueue(self, transfer: _Transfer, now: float) -> None:
        self.queues[self.fabric.tier(transfer.record)].append(transfer)
        self.queued[transfer.record.ticket] += 1
        self.done.pop(transfer.record.ticket, None)

    def landed(self, ticket: int) -> bool:
        return self.queued.get(ticket, 0) == 0

    def _head_ready(self, tier: str) -> bool:
        return all(self.landed(t) for t in self.queues[tier][0].after)

    def advance(self, now: float, until: float, busy: bool) -> None:
        """Move bytes from ``now`` to ``until``."""
        while now < until:
            step, tier = self._next_landing(now, busy)
            end = min(until, now + step) if tier else until
            self._flow(end - now, busy, end)
            now = end

    def stolen(self) -> float:
        """The share of compute speed the transfers moving now take (while the host computes)."""
        moving = [q[0] for tier, q in self.queues.items() if q and self._head_ready(tier)]
        return min(MAX_STOLEN, sum(self.fabric.stolen(t.record, t.nbytes) for t in moving))

    def compute(self, now: float, seconds: float) -> float:
        """The host computes ``seconds`` of work from ``now``, slowed while
        transfers share its cores; returns when it is done."""
        left = seconds
        while left > 1e-15:
            speed = 1.0 - self.stolen()
            step, tier = self._next_landing(now, busy=True)
            wall = left / speed
            if tier is None or step >= wall:
                self._flow(wall, True, now + wall)
                return now + wall
            self._flow(step, True, now + step)
            now, left = now + step, left - step * speed
        return now

    def run_until_landed(self, tickets: tuple[int, ...], now: float) -> float:
        """The host waits: move bytes at the waiting rate until ``tickets`` landed; the time then."""
        while not all(self.landed(t) for t in tickets):
            step, tier = self._next_landing(now, busy=False)
            if tier is None:
                raise RuntimeError(f"the schedule waits for collectives {tickets} that can never land")
            self._flow(step, False, now + step)
            now += step
        return max([now] + [self.done.get(t, 0.0) for t in tickets])

    def _rate(self, transfer: _Transfer, busy: bool) -> float:
        took = self.fabric.wire_seconds(transfer.record, transfer.nbytes, busy)
        return float("inf") if took <= 0 else 1.0 / took

    def _next_landing(self, now: float, busy: bool) -> tuple[float, str | None]:
        """Time until the first head transfer of any tier lands, and its tier."""
        best, which = float("inf"), None
        for tier, queue in self.queues.items():
            if queue and self._head_ready(tier):
                step = queue[0].left / self._rate(queue[0], busy)
                if step < best:
                    best, which = step, tier
        return best, which

    def _flow(self, span: float, busy: bool, end: float) -> None:
        # Who moves is decided at the span's start: a stage that lands now frees its follower only after it.
        moving = [tier for tier, queue in self.queues.items() if queue and self._head_ready(tier)]
        for tier in moving:
            queue = self.queues[tier]
            head = queue[0]
            rate = self._rate(head, busy)
            moved = min(head.left, span * rate)
            head.left -= moved
            self.out.busy[tier] += moved / rate if rate != float("inf") else 0.0
            if head.left <= 1e-12:
                queue.popleft()
                ticket = head.record.ticket
                self.queued[ticket] -= 1
                if self.queued[ticket] == 0:
                    self.done[ticket] = end


def replay(trace: StepTrace, compute: ComputeModel, fabric: Fabric) -> Prediction:
    """The step ``trace`` records, timed by ``compute`` and ``fabric``."""
    follows = {t: r.after for r in trace.records if isinstance(r, schedule_log.Follows) for t in r.tickets}
    out = Prediction(model_flops=trace.model_flops())
    links = _Links(fabric, out)
    issued: dict[int, schedule_log.Issued] = {}
    clock = out.compute_s = compute.step_overhead_s
    out.by_phase["framework"] = clock

    def host(seconds: float) -> None:
        nonlocal clock
        end = links.compute(clock, seconds)
        out.host_comm_s += (end - clock) - seconds
        clock = end

    def send(record: schedule_log.Issued, nbytes: int) -> None:
        links.enqueue(_Transfer(record, nbytes, follows.get(record.ticket, ())), clock)
        cost = fabric.host_seconds(record, nbytes)
        out.host_comm_s += cost
        host(cost)

    for record in trace.records:
        if isinstance(record, Op):
            took = compute.seconds(record)
            out.compute_s += took
            out.by_phase[record.phase] += took
            host(took)
        elif isinstance(record, schedule_log.Issued):
            issued[record.ticket] = record
            if not record.paced:
                send(record, record.nbytes)
        elif isinstance(record, schedule_log.Posted) and record.ticket in issued:
            send(issued[record.ticket], record.nbytes)
        elif isinstance(record, schedule_log.Waited):
            tickets = tuple(t for t in record.tickets if t in issued)
            if tickets and not all(links.landed(t) for t in tickets):
                landed = links.run_until_landed(tickets, clock)
                last = issued[max(tickets, key=lambda t: links.done.get(t, 0.0))]
                out.exposed[fabric.tier(last)] += landed - clock
                where = trace.issued_in.get(last.ticket, "")
                out.waits[f"{last.kind} {last.nbytes / 2**20:.1f} MB over {last.dim}"
                          + (f", issued in {where}" if where else "")] += landed - clock
                clock = landed
    # What is still in flight when the step's last op ends: the next step's first use waits for it.
    out.step_s = links.run_until_landed(tuple(issued), clock)
    return out
