"""The alternating schedule: A, B, C, A, B, C, ... so slow drift of a shared
machine (other jobs, thermal state) spreads over every contender instead of
landing on whichever ran last.

Each run gets a fresh process group in fresh processes: no allocator cache,
heap fragmentation or lazily-initialised state leaks from one contender into
the next one's time or peak memory. Under torchrun the ranks already exist,
so runs share them (the memory probe still resets the high-water mark).
"""

from __future__ import annotations

import sys
import time
from typing import Callable

from flatfsdp.bench.contenders import REGISTRY
from flatfsdp.bench.measure import run_contender
from flatfsdp.bench.options import BenchConfig
from flatfsdp.bench.run_records import RunRecords
from flatfsdp.launch import RankFailed, launch, under_torchrun


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def launch_locally(cfg: BenchConfig, name: str) -> dict:
    """One run on fresh local ranks (or on torchrun's)."""
    return launch(run_contender, cfg.nprocs, cfg, name, threads_per_rank=cfg.threads_per_rank)


def run_all(cfg: BenchConfig, verbose: bool = True,
            run_one: Callable[[BenchConfig, str], dict] = launch_locally,
            records: RunRecords | None = None) -> tuple[list[dict], dict[str, str]]:
    """Every run's record, in run order, and a note per contender that did not run.
    ``run_one(cfg, name)`` makes one run (behind a link: ``link_runs.LinkRuns``);
    ``records`` gets each record as the run ends (run_records.py)."""
    records = records if records is not None else RunRecords(None)
    notes = {n: why for n in cfg.contenders if (why := REGISTRY[n].unavailable())}
    active = [n for n in cfg.contenders if n not in notes]
    runs: list[dict] = []
    for round_ in range(cfg.repeats):
        for name in active:
            if name in notes:  # failed in an earlier round
                continue
            start = time.perf_counter()
            try:
                record = run_one(cfg, name)
            except RankFailed as exc:
                notes[name] = f"failed: {_last_line(str(exc))}"
                _log(f"[bench] {name} failed in round {round_ + 1}:\n{exc}")
                if is_reporting_rank():
                    records.failed(name, round_, _last_line(str(exc)))
                continue
            record["round"] = round_
            runs.append(record)
            if is_reporting_rank():
                records.ran(record)
            if verbose and is_reporting_rank():
                median = sorted(record["step_times"])[len(record["step_times"]) // 2]
                _log(f"[bench] round {round_ + 1}/{cfg.repeats} {name:9s} median step {median:.3f} s, "
                     f"peak {max(record['peak_bytes']) / 2**20:.0f} MB/rank, "
                     f"run {time.perf_counter() - start:.0f} s")
    return runs, notes


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    # The cause is usually a rank's exception line, not the gloo echo on the others.
    for line in lines:
        if not line.startswith((" ", "---", "Traceback")) and "Connection" not in line and "failed:" not in line:
            return line.strip()[:200]
    return lines[-1].strip()[:200] if lines else "unknown error"


def is_reporting_rank() -> bool:
    if not under_torchrun():
        return True
    import torch.distributed as dist
    return not dist.is_initialized() or dist.get_rank() == 0
