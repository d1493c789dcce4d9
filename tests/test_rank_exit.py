"""How a spawned rank ends: its report and its output get out, then it leaves
without interpreter shutdown.

Why no shutdown: the gloo group outlives destroy_process_group (torch's DTensor
caches keep the mesh, and so the group, alive), so gloo's worker threads still
run as the rank ends. A worker releasing a finished collective's tensors needs
the GIL; if it asks while the interpreter shuts down, CPython ends the thread
with pthread_exit and the process aborts with "terminate called without an
active exception" -- now and then, after a run that succeeded. That flake hit
the strict one-line stderr checks of the Ctrl-C and diverging-run tests.
"""

from __future__ import annotations

import atexit
import sys

import torch.distributed as dist

from flatfsdp.launch import launch


def _print_and_ask_for_shutdown_work() -> int:
    rank = dist.get_rank()
    atexit.register(print, f"interpreter shutdown ran in rank {rank}", file=sys.stderr, flush=True)
    print(f"rank {rank} was here", end="")  # neither newline nor flush: only the rank's exit writes it out
    return rank


def test_a_rank_flushes_its_output_and_skips_interpreter_shutdown(capfd):
    assert launch(_print_and_ask_for_shutdown_work, 2, timeout_s=120) == 0
    out, err = capfd.readouterr()
    assert "rank 0 was here" in out and "rank 1 was here" in out, out
    assert "interpreter shutdown ran" not in err, err
