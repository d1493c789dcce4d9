"""Peak memory of one run on one rank, above what the rank held before the model existed.

CPU: the kernel's resident-set high-water mark (VmHWM) minus the resident set
(VmRSS) read just before the model is built. The mark is reset at that moment
by writing "5" to /proc/self/clear_refs where the kernel allows it; where it
does not, runs still start in fresh processes (see ``runner``), so the mark
only holds what the imports touched. Accelerators: the allocator's peak
allocated bytes above those allocated at the start.
"""

from __future__ import annotations

import torch


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """``probe = PeakMemory(device); ... build, train ...; probe.peak_bytes()``."""

    def __init__(self, device: torch.device) -> None:
        self.on_cpu = device.type == "cpu"
        if self.on_cpu:
            self.baseline = _status_kib("VmRSS") * 1024
            self.mark_reset = _reset_high_water_mark()
            self.method = "VmHWM - VmRSS before model" + ("" if self.mark_reset else " (HWM not resettable)")
        else:
            torch.accelerator.synchronize()
            torch.accelerator.reset_peak_memory_stats()
            self.baseline = torch.accelerator.memory_allocated()
            self.mark_reset = True
            self.method = "accelerator max_memory_allocated - allocated before model"

    def peak_bytes(self) -> int:
        if self.on_cpu:
            return _status_kib("VmHWM") * 1024 - self.baseline
        torch.accelerator.synchronize()
        return torch.accelerator.max_memory_allocated() - self.baseline
