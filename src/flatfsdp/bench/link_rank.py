"""What each rank runs behind a throttled link (``link_runs`` starts it under
torchrun, inside a node's namespace):

    python -m flatfsdp.bench.link_rank CONFIG.json CONTENDER OUT.json

One contender run, exactly as ``measure.run_contender`` does it on loopback
(or, as CONTENDER ``link-probe``, a probe of the link: link_probe.py);
rank 0 writes the record to OUT.json for the bench outside the namespaces.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from flatfsdp.bench.link_probe import LINK_PROBE, probe_link_rank
from flatfsdp.bench.measure import run_contender
from flatfsdp.bench.options import BenchConfig
from flatfsdp.launch import launch

COLLECTIVE_TIMEOUT_S = 600.0
"""A rank waiting longer than this in one collective fails, naming who did not come, instead of hanging."""


def main(argv: list[str]) -> int:
    config, name, out = argv
    cfg = BenchConfig.from_dict(json.loads(Path(config).read_text()))
    torch.set_num_threads(cfg.threads_per_rank)  # torchrun pins OMP_NUM_THREADS=1; the bench decides
    if name == LINK_PROBE:  # the link itself, before any run (link_probe.py)
        record = launch(probe_link_rank, cfg.nprocs, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    else:
        record = launch(run_contender, cfg.nprocs, cfg, name, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(record))
    dist.destroy_process_group()
    return 0


def error_file(out: str | Path, rank: int | str) -> Path:
    """Where a failing rank leaves its traceback for the bench (torchrun's own log buries it)."""
    return Path(f"{out}.rank{rank}.err")


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except BaseException:  # noqa: BLE001 -- the traceback goes to the bench, the exit code to torchrun
        traceback.print_exc()
        with contextlib.suppress(Exception):
            error_file(sys.argv[3], os.environ.get("RANK", "?")).write_text(traceback.format_exc())
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    # Not through interpreter shutdown, which gloo's threads do not survive (launch._leave).
    os._exit(code)
