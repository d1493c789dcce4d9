"""An interface's transmit counter read every 2 ms by a process of
its own (``--link-timeline``; link_activity.py makes sense of it).

    python -m flatfsdp.bench.link_sampler DEVICE OUT [PERIOD_S]

reads ``/sys/class/net/DEVICE/statistics/tx_bytes`` with its monotonic time
(system-wide, so the ranks' marks share its clock) until SIGTERM, then
writes every sample to OUT, one "time bytes" line each. Started inside the
rank's network namespace, it sees the namespace's interfaces. Its loop (a
read and a sleep every 2 ms) cost 2.2% of one core here, 3.7% every 1 ms;
it runs only while a timeline is asked for. Imports no torch, so it starts
in a blink.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from flatfsdp.bench.link_activity import Counter

PERIOD_S = 0.002
_READY = "ready"
_STOP_TIMEOUT_S = 10.0


def counter_path(device: str, counter: str = "tx_bytes") -> Path:
    """Where the kernel shows ``device``'s ``counter`` (this process's network namespace)."""
    return Path("/sys/class/net") / device / "statistics" / counter


class LinkSampler:
    """``start()`` the sampling process, ``stop()`` it and read its ``Counter``."""

    def __init__(self, device: str, out: Path, period_s: float = PERIOD_S) -> None:
        if not counter_path(device).is_file():
            raise ValueError(f"--link-timeline: no transmit counter for interface '{device}' "
                             f"({counter_path(device)} does not exist in this network namespace)")
        self.device, self.out, self.period_s = device, Path(out), period_s
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "flatfsdp.bench.link_sampler", self.device,
                                       str(self.out), repr(self.period_s)], stdout=subprocess.PIPE, text=True)
        line = self._proc.stdout.readline().strip()  # its first sample is taken: the timed steps may start
        if line != _READY:
            self._proc.kill()
            raise RuntimeError(f"the link sampler for '{self.device}' did not start (it said {line!r})")

    def stop(self) -> Counter:
        proc, self._proc = self._proc, None
        if proc is None:
            raise RuntimeError("the link sampler was not started")
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise RuntimeError(f"the link sampler for '{self.device}' did not stop within {_STOP_TIMEOUT_S:.0f} s")
        if proc.returncode != 0:
            raise RuntimeError(f"the link sampler for '{self.device}' exited with {proc.returncode}")
        return read_samples(self.out)


def read_samples(path: Path) -> Counter:
    times, sent = [], []
    for line in Path(path).read_text().splitlines():
        t, b = line.split()
        times.append(float(t))
        sent.append(int(b))
    return Counter(tuple(times), tuple(sent))


def sample(device: str, out: Path, period_s: float) -> None:
    """The sampling loop (this module run as a program)."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    times, sent = [], []
    fd = os.open(counter_path(device), os.O_RDONLY)
    try:
        def read() -> None:
            sent.append(int(os.pread(fd, 32, 0)))  # sysfs formats the counter anew on each read from offset 0
            times.append(time.monotonic())
        read()
        print(_READY, flush=True)
        while not stop:
            time.sleep(period_s)
            read()
    finally:
        os.close(fd)
    Path(out).write_text("".join(f"{t:.6f} {b}\n" for t, b in zip(times, sent)))


if __name__ == "__main__":
    sample(sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else PERIOD_S)
