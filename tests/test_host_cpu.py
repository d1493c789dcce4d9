"""The bench's split of a step's host CPU into the main thread's and every
other thread's (bench/host_cpu.py): work done on another thread -- gloo's,
in a training step -- lands in the second figure, the caller's own in the first."""

from __future__ import annotations

import threading
import time

from flatfsdp.bench.host_cpu import HostCpu


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_another_threads_work_is_counted_apart_from_the_main_threads():
    cpu = HostCpu()
    cpu.start()  # a step whose work runs on another thread while the caller waits
    worker = threading.Thread(target=_burn, args=(0.2,))
    worker.start()
    worker.join()
    cpu.stop()
    cpu.start()  # a step of the caller's own work
    _burn(0.2)
    cpu.stop()
    assert cpu.other_s[0] >= 0.15 and cpu.main_s[0] < 0.05
    assert cpu.main_s[1] >= 0.19 and cpu.other_s[1] < 0.05
    assert cpu.medians() == [(cpu.main_s[0] + cpu.main_s[1]) / 2,
                             (cpu.other_s[0] + cpu.other_s[1]) / 2]


def test_nothing_measured_is_none():
    assert HostCpu().medians() is None
