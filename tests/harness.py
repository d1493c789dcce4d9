"""Run a function on N real processes (gloo on CPU) and collect each rank's result.

Workers are module-level functions ``fn(rank, world_size, *args)``; a failure on
any rank fails the caller with that rank's traceback, and a hang is cut off by
a timeout instead of stalling the suite.

Ranks fork from a server that imported torch and flatfsdp once per test
session (about 2 s saved per launch on this machine, a few hundred launches
per suite); each rank still starts from that clean server, never from an
earlier test's rank, and gets the caller's environment as it is at launch.
``fresh_interpreter=True`` spawns instead, for a test that needs what only a
new process gives (a malloc setting read at start-up, an RSS mark of its own).
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once in the fork server; the test modules themselves import per rank. flatfsdp.engine by
# name: `import flatfsdp` alone binds the API lazily and would import no engine (flatfsdp/__init__.py).
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp", "flatfsdp.engine"]


def _context(fresh_interpreter: bool):
    if fresh_interpreter:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server first starts
    return ctx


def _entry(fn, rank, world_size, port, queue, args, group_timeout_s=None, environ=None):
    if environ is not None:  # the server's environment is the session's start; the caller's may differ
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.seed()  # a forked rank would otherwise share the server's seed; spawned ones never do
    try:
        extra = {} if group_timeout_s is None else {"timeout": timedelta(seconds=group_timeout_s)}
        dist.init_process_group("gloo", rank=rank, world_size=world_size, **extra)
        result = fn(rank, world_size, *args)
        # Plain pickle copies tensors into bytes; torch's queue pickler would
        # pass shared-memory handles that die with this process.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # report everything, including assertion errors
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 600.0, group_timeout_s: float | None = None,
              fresh_interpreter: bool = False) -> list:
    """Results of ``fn`` on every rank, in rank order. ``group_timeout_s``: the
    default process group's timeout, as a user would pass it to init_process_group."""
    ctx = _context(fresh_interpreter)
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, queue, args, group_timeout_s, dict(os.environ)),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world_size):
            rank, ok, payload = queue.get(timeout=timeout)
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{payload}")
            results[rank] = pickle.loads(payload)  # our own child's results, not outside data
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
