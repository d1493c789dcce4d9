"""Memory per rank for the progress line and the log: resident set size on CPU,
allocator bytes on an accelerator. Gathered across ranks at log points only."""

from __future__ import annotations

import os
import resource
import sys

import torch
import torch.distributed as dist

_MB = 2 ** 20


def _rss_bytes() -> int:
    """Current resident set size; Linux /proc, else the peak (all getrusage gives)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def local_memory_mb(device: torch.device) -> list[float]:
    """[rss, peak rss, device allocated, device peak allocated] in MiB (device ones 0 on CPU)."""
    values = [_rss_bytes(), _peak_rss_bytes(), 0, 0]
    if device.type != "cpu":
        values[2] = torch.accelerator.memory_allocated(device)
        values[3] = torch.accelerator.max_memory_allocated(device)
    return [v / _MB for v in values]


def gather_memory_mb(device: torch.device) -> list[list[float]]:
    """Every rank's ``local_memory_mb``, on every rank (one small all-gather)."""
    mine = torch.tensor(local_memory_mb(device), dtype=torch.float64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return [[round(v, 1) for v in row.tolist()] for row in rows]
