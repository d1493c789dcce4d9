"""When a throttled link carried bytes during a step, and when it sat idle
(``--link-timeline``).

Two records, both taken on rank 0 while the timed steps run behind the link:

* the throttled interface's transmit counter, read every 2 ms by a
  process of its own (``link_sampler``; a thread in the rank would take the
  interpreter lock from the step it measures);
* marks of the step's phases (``StepMarks``): the step starts, the forward
  returns the loss, the backward returns, the optimizer step returns.

From them, per step and phase: its seconds, the bytes the link carried, and
the seconds the link carried less than half its rate. A step behind a link
can be no shorter than its bytes over the rate (the wire limit), so each idle
second of a link-bound step is a second beyond that limit -- time in which the
schedule had nothing to send. Idle spans of ``MIN_SPAN_S`` or more are listed
with the phase each starts in, timed from the step's start.

Knows numbers only (no torch): tested on made-up counters.
"""

from __future__ import annotations

import bisect
import statistics
import time
from dataclasses import dataclass
from typing import Callable

IDLE_FRACTION = 0.5
"""A sampling interval is idle when the link carried less than this share of its rate."""
MIN_SPAN_S = 0.005
"""Idle spans shorter than this are counted in the idle seconds but not listed."""
PHASE_ENDS = (("forward", "loss"), ("backward", "backward"), ("optimizer", "optimizer"))
"""Each phase and the mark that ends it; "between steps" runs from the last to the next step's start."""
BETWEEN = "between steps"


class StepMarks:
    """Phase marks of the steps a rank times. ``note(label)`` costs one check
    while off (every contender's step calls it) and one clock read while on."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.on = False
        self.marks: list[tuple[float, str]] = []
        self._clock = clock

    def note(self, label: str) -> None:
        if self.on:
            self.marks.append((self._clock(), label))


@dataclass(frozen=True)
class Counter:
    """An interface's transmit counter (bytes) at increasing ``times`` (monotonic seconds)."""
    times: tuple[float, ...]
    sent: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.times) != len(self.sent) or len(self.times) < 2:
            raise ValueError(f"a counter needs two or more (time, bytes) samples, got {len(self.times)} times "
                             f"and {len(self.sent)} values")

    def bytes_at(self, t: float) -> float:
        """The counter at ``t``, interpolated between samples (clamped at both ends)."""
        i = min(max(bisect.bisect_left(self.times, t), 1), len(self.times) - 1)
        t0, t1 = self.times[i - 1], self.times[i]
        fraction = min(max((t - t0) / (t1 - t0), 0.0), 1.0) if t1 > t0 else 1.0
        return self.sent[i - 1] + (self.sent[i] - self.sent[i - 1]) * fraction

    def idle_spans(self, start: float, end: float, rate: float) -> list[tuple[float, float]]:
        """The stretches of [start, end] in which the link carried under
        ``IDLE_FRACTION`` of ``rate`` (bytes/s): consecutive idle sampling
        intervals merged, clipped to the window."""
        spans: list[tuple[float, float]] = []
        i = max(bisect.bisect_right(self.times, start) - 1, 0)
        while i + 1 < len(self.times) and self.times[i] < end:
            t0, t1 = self.times[i], self.times[i + 1]
            if t1 > t0 and (self.sent[i + 1] - self.sent[i]) / (t1 - t0) < IDLE_FRACTION * rate:
                a, b = max(t0, start), min(t1, end)
                if b > a:
                    if spans and spans[-1][1] >= a:
                        spans[-1] = (spans[-1][0], b)
                    else:
                        spans.append((a, b))
            i += 1
        return spans


def _phases(marks: list[tuple[float, str]], end: float) -> list[tuple[str, float, float]]:
    """(phase, start, end) of one step from its marks (the first is its start).
    A step marked only at its start (a contender whose step has no phase
    marks) is one phase, "step"."""
    at = {label: t for t, label in marks[1:]}
    if not all(label in at for _, label in PHASE_ENDS):
        return [("step", marks[0][0], end)]
    phases, begin = [], marks[0][0]
    for phase, label in PHASE_ENDS:
        phases.append((phase, begin, at[label]))
        begin = at[label]
    phases.append((BETWEEN, begin, end))
    return phases


def _phase_of(phases: list[tuple[str, float, float]], t: float) -> str:
    for name, a, b in phases:
        if a <= t < b:
            return name
    return phases[-1][0]


def step_activity(counter: Counter, marks: list[tuple[float, str]], end: float, rate: float) -> dict:
    """One step: its seconds, MB carried and idle seconds, the same per phase,
    and its idle spans of ``MIN_SPAN_S`` or more (start and seconds from the step's start)."""
    start = marks[0][0]
    phases = _phases(marks, end)
    idle = counter.idle_spans(start, end, rate)  # once for the step; each phase takes its overlap

    def idle_in(a: float, b: float) -> float:
        return sum(max(0.0, min(y, b) - max(x, a)) for x, y in idle)

    rows = [dict(phase=name, seconds=b - a, bytes=counter.bytes_at(b) - counter.bytes_at(a), idle_s=idle_in(a, b))
            for name, a, b in phases]
    spans = [dict(start_s=a - start, seconds=b - a, phase=_phase_of(phases, a)) for a, b in idle if b - a >= MIN_SPAN_S]
    return dict(step_s=end - start, bytes=counter.bytes_at(end) - counter.bytes_at(start),
                idle_s=sum(b - a for a, b in idle), phases=rows, spans=spans)


def split_steps(marks: list[tuple[float, str]]) -> list[tuple[list[tuple[float, str]], float]]:
    """Each step's marks (from its "step" mark) and its end: the next step's
    start, or the closing "end" mark."""
    starts = [i for i, (_, label) in enumerate(marks) if label == "step"]
    ends = [t for t, label in marks if label == "end"]
    steps = []
    for k, i in enumerate(starts):
        if k + 1 < len(starts):
            steps.append((marks[i:starts[k + 1]], marks[starts[k + 1]][0]))
        elif ends:
            steps.append(([m for m in marks[i:] if m[1] != "end"], ends[-1]))
    return steps


def activity(counter: Counter, marks: list[tuple[float, str]], rate: float) -> dict:
    """Every timed step's activity, and the median step's (by step time) as the summary."""
    steps = [step_activity(counter, step, end, rate) for step, end in split_steps(marks)]
    if not steps:
        raise ValueError("no complete step among the marks: each step needs a 'step' mark, the last an 'end'")
    ranked = sorted(steps, key=lambda s: s["step_s"])
    return dict(rate=rate, steps=steps, median_step=ranked[(len(ranked) - 1) // 2],
                median_idle_s=statistics.median(s["idle_s"] for s in steps))
