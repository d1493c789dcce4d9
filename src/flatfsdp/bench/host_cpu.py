"""Where a rank's host CPU went during its timed steps: its main thread (the
model's ops, the engine's hooks and copies, the optimizer) and every other
thread of the process (gloo's transport threads moving bytes; on an
accelerator, the runtime's).

On a host whose ranks fill the cores, a step is about the main thread's CPU,
plus the other threads' (they take the same cores), plus the time the rank
waited with nothing to do -- which splits a time model's error into its
compute, its host cost of communication and its waits (prediction_table.py).
Measured 2026-11-28, small-batch GPT, 2 ranks on the 2-core host: the floor's
main thread 0.36-0.40 s a step with the other threads at 0.00-0.02; flatfsdp's
main thread 0.40-0.49 s, other threads 0.06-0.11 s, for the 174 MB each rank sent.
"""

from __future__ import annotations

import statistics
import time

try:
    import resource
except ImportError:  # not a POSIX host: the split is not measured there
    resource = None


class HostCpu:
    """A clock of this process's CPU seconds, read around each timed step."""

    def __init__(self):
        self.main_s: list[float] = []
        self.other_s: list[float] = []
        self._start: tuple[float, float] | None = None

    @staticmethod
    def _read() -> tuple[float, float]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return time.thread_time(), usage.ru_utime + usage.ru_stime

    def start(self) -> None:
        if resource is not None:
            self._start = self._read()

    def stop(self) -> None:
        """One step ended (call from the thread that called ``start``: the main thread's CPU is its own)."""
        if self._start is None:
            return
        main, process = self._read()
        main_s, other_s = main - self._start[0], (process - self._start[1]) - (main - self._start[0])
        self.main_s.append(main_s)
        # rusage ticks coarser than the thread clock: a step with no other thread can read a hair below zero.
        self.other_s.append(max(0.0, other_s))
        self._start = None

    def medians(self) -> list[float] | None:
        """[main thread, other threads] CPU seconds of a median step, or None where not measured."""
        if not self.main_s:
            return None
        return [statistics.median(self.main_s), statistics.median(self.other_s)]
