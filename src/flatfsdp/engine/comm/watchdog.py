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

The limit (`wait_limit`): the process group's own timeout when the user chose
one (``init_process_group(timeout=...)``, or ``new_group(timeout=...)`` for the
group waited on), else `DEFAULT_TIMEOUT_S`; ``FLATFSDP_TIMEOUT`` (seconds) in
the environment lowers it. Whichever is shorter rules: a user who asked the
group for 20 s gets an error after 20 s, not after the engine's five minutes.
torch's own default (30 minutes for gloo) counts as "not chosen": it is what
makes a mistake look like a hang. ``flatfsdp train --timeout`` and
``flatfsdp.launch`` set both for their ranks; under a user's torchrun, export
``FLATFSDP_TIMEOUT`` or pass the group a timeout.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as dc10d

from flatfsdp.engine.layout.switches import TIMEOUT_ENV

DEFAULT_TIMEOUT_S = 300.0
"""Five minutes: far above any healthy wait (a step's slowest collective), far
below gloo's 30-minute default that makes a mistake look like a hang."""


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than the limit: which one, where, who is missing."""

    def __init__(self, message: str, missing: tuple[int, ...] | None):
        super().__init__(message)
        self.missing = missing
        """Global ranks that did not arrive (None: the backend does not say)."""


def _group_timeout(group: "dist.ProcessGroup | None") -> float | None:
    """The timeout a user gave ``group`` (seconds), None when it has torch's
    default. Read from the backend's options: torch keeps it there and offers
    no public getter."""
    if group is None:
        return None
    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):  # another backend, or a torch that moved it
        return None
    default = dc10d._get_default_timeout(dist.get_backend(group))
    if not isinstance(timeout, timedelta) or timeout == default or timeout <= timedelta(0):
        return None
    return timeout.total_seconds()


def wait_limit(group: "dist.ProcessGroup | None", env: float | None = None) -> tuple[float, str]:
    """(seconds, where that limit comes from, for the error message): the
    shortest of FLATFSDP_TIMEOUT (``env``, read once: layout/switches.py),
    the waited group's timeout and the default group's timeout (a mesh's
    sub-groups get torch's default unless told)."""
    candidates = []
    if env is not None:
        candidates.append((env, f"{TIMEOUT_ENV}={env:g} (flatfsdp train --timeout)"))
    world = dist.group.WORLD if dist.is_initialized() else None
    for g in (group, world) if group is not world else (group,):
        chosen = _group_timeout(g)
        if chosen is not None:
            candidates.append((chosen, f"the process group's timeout of {chosen:g} s "
                                       "(init_process_group(timeout=...))"))
    if not candidates:
        return DEFAULT_TIMEOUT_S, (f"the default {DEFAULT_TIMEOUT_S:g} s (set {TIMEOUT_ENV}, flatfsdp train "
                                   "--timeout, or the process group's timeout)")
    return min(candidates, key=lambda c: c[0])


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def wait_works(works: list, peers: list | None, group: "dist.ProcessGroup | None", label: str,
               env_timeout: float | None = None) -> None:
    """Wait for every work (``peers[i]``: the group rank work i exchanges with,
    None for a collective); raise CollectiveTimeout past the limit."""
    if group is None or dist.get_backend(group) != "gloo":
        for work in works:
            work.wait()
        return
    seconds, source = wait_limit(group, env_timeout)
    limit = timedelta(seconds=seconds)
    for index, work in enumerate(works):
        try:
            work.wait(limit)
        except RuntimeError as exc:
            if not _is_timeout(exc):
                raise
            raise _timeout(works[index:], (peers or [None] * len(works))[index:], group, label, seconds,
                           source) from None


def _timeout(works: list, peers: list, group, label: str, seconds: float, source: str) -> CollectiveTimeout:
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
        f"looks like this). Limit: {source}", known)
