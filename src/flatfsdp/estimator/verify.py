"""The estimate checked against reality: the same step run on real ranks of
this machine (gloo), its high-water mark read from the CPU allocator itself.

The allocator's view comes from torch's profiler with memory profiling on:
it reports every allocation and free the CPU allocator makes, wherever it is
made (inside ops, autograd, the optimizer, DTensor's own dispatch, the
engine's buffers re-allocated in place). The peak of a step is the bytes alive
at its start plus the highest running sum of those events -- no dispatch
mode, no weak references, nothing the estimator itself uses. Blocks gloo
allocates inside a collective are the one thing left out (see `_highest_rise`).

Collectives run as the accelerator backends run them (one native collective
each, ``FLATFSDP_GLOO_ALGORITHM=native``): the estimate describes that path,
not gloo's point-to-point exchange, whose receive scratch it would not show.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass
from typing import Iterator

from torch.profiler import ProfilerActivity, profile, record_function

from flatfsdp.estimator.estimate import estimate_layout
from flatfsdp.estimator.live_bytes import distinct_storages
from flatfsdp.estimator.models import resolve_model
from flatfsdp.estimator.rank_step import Layout, RankFigures, make_mesh, measure


STEP_LABEL = "flatfsdp::estimator::metered_step"
METERED_STEPS = 3
"""Real steps metered per layout; the lowest peak counts (see AllocatorPeak)."""


class AllocatorPeak:
    """`rank_step.Meter` reading the CPU allocator through the profiler.

    Profiling starts before the warm-up step, not at the metered ones: the
    profiler cannot report the free of a block allocated before it started, and
    a buffer the warm-up step allocates may be freed in a metered step.

    With several metered steps the lowest peak counts. The engine's schedule is
    the same every step; what varies is gloo: a block a collective used is
    freed only when gloo's worker thread lets go of it, which under load can
    come after the engine's next allocation. That only ever adds (and has no
    counterpart on an accelerator, where the engine keeps such a buffer until
    the compute stream has waited for the collective), so the step gloo
    delayed least is the engine's own schedule."""

    def __init__(self) -> None:
        self.start = self.peak_total = 0
        self.engine_transient_peak = self.other_new_peak = 0  # the allocator cannot tell them apart
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._starts: list[int] = []

    def __enter__(self) -> "AllocatorPeak":
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        if exc[0] is None:
            rises = _rises(self._profile, len(self._starts))
            best = min(range(len(rises)), key=lambda i: self._starts[i] + rises[i])
            self.start, self.peak_total = self._starts[best], self._starts[best] + rises[best]

    @contextlib.contextmanager
    def step(self, known: list, resizable: list) -> Iterator[None]:
        self._starts.append(sum(s.nbytes() for s in distinct_storages(list(known) + list(resizable))))
        with record_function(f"{STEP_LABEL}{len(self._starts) - 1}"):
            yield


def _rises(prof, steps: int) -> list[int]:
    """For each metered step: the most the allocator's bytes rose above their
    level at its start, while it ran. Blocks a collective allocates inside
    the backend (gloo copies a reduce-scatter's input and stages all-gathers;
    NCCL does neither) are left out, with their frees: the estimate describes
    the engine, not gloo."""
    from torch._C._profiler import _EventType  # the profiler's event kinds (no public name)

    events, windows = [], {}
    stack = [(event, False) for event in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        event, in_collective = stack.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            fields = event.extra_fields
            events.append((event.start_time_ns, fields.alloc_size, fields.ptr, in_collective))
        elif event.name.startswith(STEP_LABEL):
            windows[int(event.name[len(STEP_LABEL):])] = (event.start_time_ns, event.end_time_ns)
        inside = in_collective or event.name.startswith(("c10d::", "gloo:"))  # the op, or gloo's worker running it
        stack += [(child, inside) for child in event.children]
    if sorted(windows) != list(range(steps)):
        raise RuntimeError(f"the profile holds {len(windows)} of the {steps} metered steps")
    events.sort(key=lambda e: e[0])
    rises = []
    for begin, end in (windows[i] for i in range(steps)):
        level, base, rise, backend_blocks = 0, None, 0, set()
        for time_ns, size, ptr, in_collective in events:
            if time_ns >= begin and base is None:
                base = level
            if time_ns > end:
                break
            if size > 0 and in_collective:
                backend_blocks.add(ptr)
                continue
            if size < 0 and ptr in backend_blocks:
                backend_blocks.discard(ptr)
                continue
            level += size
            if base is not None:
                rise = max(rise, level - base)
        rises.append(rise)
    return rises


@dataclass
class Comparison:
    layout: Layout
    predicted: RankFigures
    measured: RankFigures

    @property
    def peak_error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted.peak - self.measured.peak) / self.measured.peak


def measure_real(model: str, layouts: list[Layout]) -> list[RankFigures]:
    """Rank 0's figures for each layout (all of one world size), on the ranks
    of this launch (call it through ``flatfsdp.launch.launch``)."""
    os.environ["FLATFSDP_GLOO_ALGORITHM"] = "native"  # this spawned rank's own environment
    spec = resolve_model(model)
    figures = []
    for layout in layouts:
        _, mesh_kwargs = make_mesh(layout)
        figures.append(measure(spec, layout, mesh_kwargs, AllocatorPeak(), metered_steps=METERED_STEPS))
    return figures


def compare(model: str, layouts: list[Layout], *, timeout_s: float = 600) -> list[Comparison]:
    """Predict each layout, then run it for real on as many local ranks; layouts
    of one world size share a launch."""
    from flatfsdp.launch import launch

    spec = resolve_model(model)
    predicted = [estimate_layout(spec, layout) for layout in layouts]
    measured: dict[int, RankFigures] = {}
    for world, group in itertools.groupby(sorted(range(len(layouts)), key=lambda i: layouts[i].world),
                                          key=lambda i: layouts[i].world):
        indices = list(group)
        for index, figures in zip(indices, launch(measure_real, world, model, [layouts[i] for i in indices],
                                                  timeout_s=timeout_s)):
            measured[index] = figures
    return [Comparison(layout, predicted[i], measured[i]) for i, layout in enumerate(layouts)]
