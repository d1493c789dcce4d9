"""Run a function on N local ranks, or on the ranks torchrun already started.

``launch(fn, nprocs, *args)`` is what the training and benchmark commands call:

* under ``torchrun`` (RANK and WORLD_SIZE set) this process already *is* a rank:
  initialise the default process group if nobody has, call ``fn(*args)``, and
  return its value (every rank gets its own);
* otherwise spawn ``nprocs`` fresh processes on this host, give each the
  torchrun-style environment, initialise the group (gloo on CPU; the
  accelerator's backend, one device per local rank, when there is one), run
  ``fn(*args)`` on each, and return rank 0's value in the parent.

A rank that raises fails the whole launch with that rank's traceback, and the
other ranks are killed rather than left blocked in a collective forever.

``forward_sigint=True`` is for ranks that handle Ctrl-C themselves (the training
command saves a checkpoint): the parent then passes its first SIGINT on to every
rank instead of dying, and stops the ranks only at a second one. A launch that
fails after a SIGINT raises ``LaunchInterrupted``.

A spawned rank ends with ``os._exit`` once its report is sent, never through
interpreter shutdown, which torch's gloo threads do not survive (see `_leave`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue as queue_module
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flatfsdp

_POLL_S = 0.2
"""How often the parent checks on its ranks while waiting for their reports."""
_GRACE_S = 5.0
"""How long a failed launch waits for the other ranks to die after SIGTERM before SIGKILL."""


class RankFailed(RuntimeError):
    """A launched rank raised (the message carries its traceback) or died."""


class LaunchInterrupted(RankFailed):
    """The ranks failed or were stopped after Ctrl-C (SIGINT) reached the launcher."""


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, backend: str | None = None,
           threads_per_rank: int = 1, timeout_s: float | None = None, forward_sigint: bool = False,
           collective_timeout_s: float | None = None) -> Any:
    """Run ``fn(*args)`` on every rank; return rank 0's result (this rank's under torchrun).

    ``fn`` must be importable by name (a module-level function) so spawned ranks
    can unpickle it. ``timeout_s`` bounds the whole spawned run (None: no bound).
    ``forward_sigint``: see the module docstring. ``collective_timeout_s``: how
    long a rank waits in a collective before failing with an error that names
    the ranks that did not come (the process group's timeout, and the engine's
    through ``flatfsdp.TIMEOUT_ENV``); None: the defaults.
    """
    if under_torchrun():
        _set_collective_timeout(collective_timeout_s)
        _init_group(backend, int(os.environ.get("LOCAL_RANK", 0)), collective_timeout_s)
        return fn(*args)
    if nprocs < 1:
        raise ValueError(f"nprocs must be at least 1, got {nprocs}")
    return _spawn(fn, nprocs, args, backend, threads_per_rank, timeout_s, forward_sigint, collective_timeout_s)


def _set_collective_timeout(seconds: float | None) -> None:
    """This process is a rank: the engine reads its limit from the environment."""
    if seconds is not None:
        os.environ[flatfsdp.TIMEOUT_ENV] = repr(float(seconds))


def _init_group(backend: str | None, local_rank: int, timeout_s: float | None = None) -> None:
    """Initialise the default group from the environment, once per process."""
    if dist.is_initialized():
        return
    backend = backend or default_backend()
    extra = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    if backend == "gloo" or not torch.accelerator.is_available():
        dist.init_process_group(backend, **extra)
        return
    # One device per local rank; naming it binds the group to it up front
    # instead of leaving the backend to guess the rank-to-device mapping.
    torch.accelerator.set_device_index(local_rank)
    device = torch.device(torch.accelerator.current_accelerator().type, local_rank)
    dist.init_process_group(backend, device_id=device, **extra)


def default_backend() -> str:
    """gloo on CPU; the accelerator's own backend (nccl on CUDA, ...) when there is one."""
    if torch.accelerator.is_available():
        return dist.get_default_backend_for_device(torch.accelerator.current_accelerator())
    return "gloo"


def _rendezvous_store() -> dist.TCPStore:
    """The ranks' rendezvous store, hosted by this (parent) process on a port
    the kernel picks as it binds: nothing is released between choosing a port
    and listening on it, so launches started at once never race for one (a
    port probed free, closed and handed to rank 0 to bind could be taken in
    between). The ranks join it as clients, as under torchrun's agent
    (``TORCHELASTIC_USE_AGENT_STORE``); it lives until the launch returns."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=10))


def _rank_main(fn, rank: int, world: int, port: int, backend: str | None, threads: int,
               reports, args: tuple, collective_timeout_s: float | None = None, interrupted=None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      TORCHELASTIC_USE_AGENT_STORE="True")  # the parent hosts the store: _rendezvous_store
    _set_collective_timeout(collective_timeout_s)
    torch.set_num_threads(threads)
    try:
        # Started with SIGINT ignored (Note [Ctrl-C while ranks start]); from here a
        # Ctrl-C is a KeyboardInterrupt that goes into this rank's report, not onto stderr.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if interrupted is not None and interrupted.is_set():
            raise KeyboardInterrupt("Ctrl-C while this rank was starting")
        _init_group(backend, rank, collective_timeout_s)
        result = fn(*args)
        # Plain pickle turns tensors into bytes: torch's queue pickler would send
        # shared-memory handles that die with this process.
        reports.put((rank, True, pickle.dumps(result if rank == 0 else None)))
    except BaseException:  # noqa: BLE001 -- every failure, assertions included, goes to the parent
        reports.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _leave(reports)


def _leave(reports) -> NoReturn:
    """End this rank process without interpreter finalization, once its report
    and output are out.

    The gloo group outlives ``destroy_process_group``: torch's DTensor caches
    keep the DeviceMesh, and so the group, alive, and gloo stops its worker
    threads only when the group is freed. A worker that has just finished a
    collective still needs the GIL to let go of that collective's tensors
    (torch drops their Python objects under it). Should this interpreter be
    finalizing by then, CPython ends that thread with pthread_exit, whose
    unwinding through torch's noexcept destructor calls std::terminate: the
    rank aborts and stderr gets "terminate called without an active
    exception" after a run that succeeded. Without finalization no thread is
    asked to exit; the OS reclaims threads and sockets, as multiprocessing
    does for every child it forks.
    """
    reports.close()
    reports.join_thread()  # the report is in the pipe, where the parent reads it
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # the reader may be gone
            stream.flush()
    os._exit(0)


def _spawn(fn, nprocs: int, args: tuple, backend: str | None, threads: int, timeout_s: float | None,
           forward_sigint: bool = False, collective_timeout_s: float | None = None) -> Any:
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    interrupted = ctx.Event() if forward_sigint else None
    store = _rendezvous_store()
    port = store.port
    procs = [ctx.Process(target=_rank_main, args=(fn, r, nprocs, port, backend, threads, reports, args,
                                                  collective_timeout_s, interrupted),
                         daemon=True, name=f"flatfsdp-rank{r}") for r in range(nprocs)]
    forwarder = _SigintForwarder(procs, interrupted) if forward_sigint else None
    ok = False
    with forwarder or contextlib.nullcontext():
        with _children_ignore_sigint():
            for p in procs:
                p.start()
        try:
            payload = _collect(procs, reports, timeout_s)
            ok = True
        except (RankFailed, KeyboardInterrupt) as exc:
            if forwarder is not None and forwarder.presses:
                raise LaunchInterrupted(str(exc) or "stopped by a second Ctrl-C") from None
            raise
        finally:
            _stop(procs, graceful=ok)
            del store  # the ranks are gone: stop listening
    return pickle.loads(payload)  # produced by our own child a moment ago


@contextlib.contextmanager
def _children_ignore_sigint():
    """Note [Ctrl-C while ranks start]
    A terminal's Ctrl-C reaches every process of the foreground group, the
    ranks too. A rank still importing torch (spawn's bootstrap, before any of
    our code runs) would die printing a KeyboardInterrupt traceback -- a
    screenful from every rank. So the ranks are started with SIGINT ignored
    (the one disposition that survives exec, and Python keeps it), and
    `_rank_main` takes it back as its first act; a press that fell into the
    window in between is not lost: the parent's forwarder also sets an event
    the rank reads right then. The parent ignores SIGINT only for the few
    milliseconds of fork and exec."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class _SigintForwarder:
    """While installed: the first SIGINT is sent on to every live rank (which
    decide what to do with it) and noted in ``interrupted`` (for ranks still
    starting); a second one raises KeyboardInterrupt here, and the launch then
    stops the ranks."""

    def __init__(self, procs: list, interrupted=None):
        self.procs = procs
        self.interrupted = interrupted
        self.presses = 0
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.presses += 1
        if self.presses > 1:
            raise KeyboardInterrupt
        if self.interrupted is not None:
            self.interrupted.set()
        for p in self.procs:
            if p.pid is not None and p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGINT)

    def __enter__(self) -> "_SigintForwarder":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _collect(procs: list, reports, timeout_s: float | None) -> bytes:
    """Wait for every rank's report; fail fast on the first error or silent death."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending, payload = set(range(len(procs))), b""
    while pending:
        try:
            rank, ok, data = reports.get(timeout=_POLL_S)
        except queue_module.Empty:
            _check_alive(procs, reports, pending)
            if deadline is not None and time.monotonic() > deadline:
                raise RankFailed(f"ranks {sorted(pending)} did not finish within {timeout_s:.0f} s")
            continue
        if not ok:
            raise RankFailed(_failure_report(procs, reports, {rank: data}))
        pending.discard(rank)
        if rank == 0:
            payload = data
    return payload


def _check_alive(procs: list, reports, pending: set) -> None:
    for rank in sorted(pending):
        code = procs[rank].exitcode
        # A clean exit (0) flushed its report into the queue first; the next get
        # reads it. Anything else exited without one: killed (OOM, a signal) or
        # crashed below Python.
        if code not in (None, 0):
            raise RankFailed(_failure_report(procs, reports, {}))


def _failure_report(procs: list, reports, errors: dict) -> str:
    """Every rank's failure, not just the first to arrive: when one rank dies the
    others fail a moment later with connection errors, and the first report in
    the queue is often such a symptom rather than the cause."""
    time.sleep(_POLL_S * 5)
    while True:
        try:
            rank, ok, data = reports.get(timeout=_POLL_S)
        except queue_module.Empty:
            break
        if not ok:
            errors.setdefault(rank, data)
    for rank, p in enumerate(procs):
        if rank not in errors and p.exitcode not in (None, 0):
            errors[rank] = f"died with exit code {p.exitcode} before reporting\n"
    parts = [f"--- rank {rank} ---\n{text}" for rank, text in sorted(errors.items())]
    return f"{len(errors)} of {len(procs)} ranks failed:\n" + "".join(parts)


def _stop(procs: list, graceful: bool) -> None:
    if graceful:
        for p in procs:
            p.join(timeout=_GRACE_S * 6)
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _GRACE_S
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
