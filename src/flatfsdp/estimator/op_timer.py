"""Every op of a real step, timed: what a probe of this machine learns about
a model's compute (compute_cost.Measured reads it back).

A dispatch mode times each op. On the CPU it runs between two clock reads;
each op also costs its dispatch (a trivial op's time, measured apart), and
the step run without the mode, minus the ops and their dispatch, is the
model's own Python and autograd bookkeeping, a fixed cost a step. On an
accelerator two device events bracket the op on its stream and nothing waits
between ops, so each op's time is its kernels': the device is kept busy while the host
queues the op, so the events do not take in its launch (synchronising around
every op instead predicted an H200's 0.37 s step 52% long; events alone, 20%:
this mode's own Python per op slows the host below training's). An op there
costs the longer of its kernels and its dispatch (``OpRates.overlapped``).
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flatfsdp.estimator.compute_cost import OpRates
from flatfsdp.estimator.schedule_trace import describe_op, is_compute


BUSY_CYCLES = 1_000_000
"""About 0.5 ms of a GPU's clock: longer than the host takes to queue an op."""


def queue_busy_wait(device: torch.device, cycles: int) -> bool:
    """Queue ``cycles`` of the device's clock of doing nothing on its current
    stream, so what the host queues next starts only after it. False where
    the device kind has no such kernel (then nothing is queued)."""
    if device.type != "cuda":
        return False
    torch.cuda._sleep(cycles)
    return True


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


class OpTimer(TorchDispatchMode):
    """Times every compute op run inside it: ``timed`` holds (Op, seconds),
    complete once the mode is left."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.timed: list = []
        self._events: list = []
        """(Op, start, end) device events not yet read (an accelerator's)."""

    @property
    def overlapped(self) -> bool:
        """Timed on the device, the host running ahead (see the module docstring)."""
        return self.device.type != "cpu"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not is_compute(func):
            return func(*args, **kwargs)
        if self.overlapped:
            start, end = (torch.Event(device=self.device, enable_timing=True) for _ in range(2))
            # The device busy while the host queues the op: its events then bracket
            # its kernels alone, not the launch (the probe's host is slower than
            # training's: this mode runs Python around every op).
            queue_busy_wait(self.device, BUSY_CYCLES)
            start.record()
            out = func(*args, **kwargs)
            end.record()
            self._events.append((describe_op(func, args, kwargs, out, ""), start, end))
            return out
        start = time.perf_counter()
        out = func(*args, **kwargs)
        took = time.perf_counter() - start
        self.timed.append((describe_op(func, args, kwargs, out, ""), took))
        return out

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        if self._events:
            _sync(self.device)
            self.timed += [(op, start.elapsed_time(end) / 1e3) for op, start, end in self._events]
            self._events = []
        return result


def dispatch_seconds(device: torch.device, repeats: int = 5000) -> float:
    """What dispatching one trivial op costs here (a view and an in-place add, averaged)."""
    t = torch.ones(16, device=device)
    for _ in range(200):
        t.view(-1).add_(0)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        t.view(-1).add_(0)
    _sync(device)
    return (time.perf_counter() - start) / (2 * repeats)


RATE_MIN_FLOPS = 10_000_000
RATE_MIN_BYTES = 256 << 10
"""Ops this large make the rates an unmeasured op's work is priced at: in a
smaller one the fixed cost of running it outweighs its work."""


def rates_from(timed: list, plain_step_s: float, per_op_s: float, steps: int = 1,
               overlapped: bool = False) -> OpRates:
    """``OpRates`` from ``steps`` timed steps, the same step's time unobserved
    and what an op's dispatch costs (``overlapped``: ``OpTimer.overlapped``)."""
    by_key: dict[tuple, list[float]] = defaultdict(list)
    work: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    flops, flop_time, nbytes, byte_time = 0, 0.0, 0, 0.0
    for op, took in timed:
        by_key[op.key].append(took)
        if op.flops < RATE_MIN_FLOPS and op.nbytes < RATE_MIN_BYTES:
            continue  # a rate of work, not of fixed costs
        entry = work[op.name]
        entry[0] += took
        entry[1] += op.flops or op.nbytes
        if op.flops:
            flops, flop_time = flops + op.flops, flop_time + took
        else:
            nbytes, byte_time = nbytes + op.nbytes, byte_time + took
    rates = OpRates(per_op_s=per_op_s, overlapped=overlapped)
    own = sum(rates.cost(took) for _, took in timed)
    return OpRates(by_key={k: sum(v) / len(v) for k, v in by_key.items()},
                   per_unit={name: t / w for name, (t, w) in work.items() if w}, per_op_s=per_op_s,
                   overlapped=overlapped, step_overhead_s=max(0.0, plain_step_s - own / steps),
                   flop_s=flop_time / flops if flops else 0.0, byte_s=byte_time / nbytes if nbytes else 0.0)
