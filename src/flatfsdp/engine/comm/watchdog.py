"""Waiting for a collective, with a limit: a rank that never arrives becomes an
error naming the unit, the phase and that rank -- in minutes, not gloo's
default half hour, and not a silent hang.

Every wait of the engine's communication goes through `wait_works` (via
``collectives.Pending.wait``). On gloo each work handle is waited with a
timeout (gloo's ``Work.wait(timeout)`` honours it for send/recv and for its
collectives); the engine's gathers and reduce-scatters on gloo are pairwise
messages, each with a known peer, so the peers whose messages never came are
exactly the ranks that did not arrive. gloo's own collectives (all-reduce of
replicated groups) do not say which rank is missing; the error says so.

On NCCL a timed host wait would block the host and end overlap, so the engine
leaves it to the process group's own timeout and watchdog (set it with
``init_process_group(timeout=...)``; the launcher does).

The limit: ``FLATFSDP_TIMEOUT`` (seconds) in the environment, else
`DEFAULT_TIMEOUT_S`. ``flatfsdp train --timeout`` and ``flatfsdp.launch`` set
it for their ranks; under a user's torchrun, export it.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0
"""Five minutes: far above any healthy wait (a step's slowest collective), far
below gloo's 30-minute default that makes a mistake look like a hang."""

TIMEOUT_ENV = "FLATFSDP_TIMEOUT"


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than the limit: which one, where, who is missing."""

    def __init__(self, message: str, missing: tuple[int, ...] | None):
        super().__init__(message)
        self.missing = missing
        """Global ranks that did not arrive (None: the backend does not say)."""


def timeout_seconds() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return value


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def wait_works(works: list, peers: list | None, group: "dist.ProcessGroup | None", label: str) -> None:
    """Wait for every work (``peers[i]``: the group rank work i exchanges with,
    None for a collective); raise CollectiveTimeout past the limit."""
    if group is None or dist.get_backend(group) != "gloo":
        for work in works:
            work.wait()
        return
    seconds = timeout_seconds()
    limit = timedelta(seconds=seconds)
    for index, work in enumerate(works):
        try:
            work.wait(limit)
        except RuntimeError as exc:
            if not _is_timeout(exc):
                raise
            raise _timeout(works[index:], (peers or [None] * len(works))[index:], group, label, seconds) from None


def _timeout(works: list, peers: list, group, label: str, seconds: float) -> CollectiveTimeout:
    """The first of ``works`` timed out; the others are polled (their peers'
    connections are not the one gloo just closed) to name every missing rank."""
    missing = {peers[0]} if peers[0] is not None else set()
    for work, peer in zip(works[1:], peers[1:]):
        if peer is None or peer in missing:
            continue
        try:
            work.wait(timedelta(milliseconds=10))
        except RuntimeError:
            missing.add(peer)
    me = dist.get_rank()
    what = f"{label} " if label else "a collective "
    if peers[0] is None:
        ranks, known = "some rank of the group did not arrive (gloo's collective does not say which)", None
    else:
        known = tuple(sorted(dist.get_global_rank(group, p) for p in missing))
        ranks = f"rank(s) {', '.join(map(str, known))} did not arrive"
    return CollectiveTimeout(
        f"{what}on rank {me} waited {seconds:g} s: {ranks}. Every rank must run the same forward/backward "
        f"passes in the same order (a forward on some ranks only, or a rank that stopped or is stuck, "
        f"looks like this). Limit: {TIMEOUT_ENV}={seconds:g} (flatfsdp train --timeout)", known)
