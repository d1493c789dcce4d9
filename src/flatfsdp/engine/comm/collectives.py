"""Stateless collectives over flat buffers, each counted in the communication account.

Every function takes the tensors it reads and writes and returns a small
``Pending`` record; callers wait on it where the result is first needed, which
is how overlap is expressed on both accelerators (a side stream and an event)
and CPU (gloo work handles).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from flatfsdp.engine.comm.comm_account import comm_account
from flatfsdp.engine.layout.device import SideStream, event_done, wait_event
from flatfsdp.engine.comm.exchange import exchange_all_gather, exchange_reduce_scatter, post_messages
from flatfsdp.engine.layout.switches import Transport
from flatfsdp.engine.layout.views import same_start
from flatfsdp.engine.comm.torch_collectives import all_gather_single, reduce_scatter_single
from flatfsdp.engine.comm.watchdog import wait_works


@dataclass(eq=False)  # identity: the reduction queue finds a Pending among others by what it is
class Pending:
    """A collective in flight, plus the work to do once it lands.

    It may be the first of a chain (``chain``): a collective that needs this
    one's result -- HSDP's all-reduce of a reduce-scattered chunk across
    replicas, HFSDP's outer reduce-scatter -- is issued once this one has
    landed, by ``advance`` (never blocking: the reduction queue polls it
    between units) or by ``wait``; ``then`` runs after the last."""

    works: list = field(default_factory=list)
    then: list[Callable[[], None]] = field(default_factory=list)
    events: list = field(default_factory=list)
    """Side-stream events marking the ends of its collectives (accelerators;
    empty on CPU): the compute stream waits on each before reading a result."""
    peers: list | None = None
    """The group rank each work exchanges with (pairwise messages); None: collectives."""
    group: "dist.ProcessGroup | None" = None
    label: str = ""
    """What this is, for an error: "unit 'blocks.0': forward gather (all_gather)"."""
    timeout_s: float | None = None
    """FLATFSDP_TIMEOUT as the transport carries it (comm/watchdog.py)."""
    kind: str = ""
    """The collective's kind, under which the account books the time waited for it."""
    _landed: list[int] = field(default_factory=list)
    """Tickets of the stage last waited for (what a follow-up stage follows)."""
    _chain: list = field(default_factory=list)
    """(callbacks of the stage in flight, issue the next stage) pairs, in order."""
    followed: bool = False
    """A follow-up stage has been issued: the first stage's inputs are spent."""
    tickets: list[int] = field(default_factory=list)
    """The account's tickets of the collectives in flight (comm/schedule_log.py)."""

    @classmethod
    def joined(cls, stages: list["Pending"], **fields) -> "Pending":
        """Several collectives in flight as one: their works waited together,
        their callbacks in order, the first's label and transport unless
        ``fields`` say otherwise. Peers stay paired with their works where every
        stage is pairwise (None, a collective, if any is not)."""
        first = stages[0] if stages else cls()
        peers = (None if any(p.peers is None for p in stages) else [peer for p in stages for peer in p.peers])
        described = dict(group=first.group, label=first.label, timeout_s=first.timeout_s, kind=first.kind)
        return cls(works=[w for p in stages for w in p.works], then=[c for p in stages for c in p.then],
                   events=[e for p in stages for e in p.events], peers=peers,
                   tickets=[t for p in stages for t in p.tickets], **{**described, **fields})

    def chain(self, issue: Callable[[], "Pending"]) -> None:
        """Once what is in flight lands and the callbacks added so far ran,
        ``issue()`` the next collective; callbacks added after this call run
        once that one lands."""
        self._chain.append((self.then, issue))
        self.then = []

    @property
    def chained(self) -> bool:
        """A follow-up collective is still to be issued."""
        return bool(self._chain)

    def advance(self) -> None:
        """Issue the follow-ups whose predecessors have landed, without blocking."""
        while self._chain and all(w.is_completed() for w in self.works):
            self.next_stage()

    def next_stage(self) -> None:
        """Wait for the stage in flight, run its callbacks, issue the next."""
        self._wait_works()
        callbacks, issue = self._chain.pop(0)
        for callback in callbacks:
            callback()
        following = issue()
        comm_account().follows(following.tickets, self._landed)
        self.followed = True
        self.tickets = following.tickets
        self.works, self.peers, self.group = following.works, following.peers, following.group
        self.events, self.timeout_s, self.kind = following.events, following.timeout_s, following.kind
        if self._chain:  # its own callbacks run before the stage after it
            after, nxt = self._chain[0]
            self._chain[0] = (following.then + after, nxt)
        else:
            self.then = following.then + self.then

    def wait(self) -> None:
        while self._chain:
            self.next_stage()
        self._wait_works()
        self._run_callbacks()

    def landed(self) -> bool:
        """Nothing left to issue and every stage done -- on the host and on the
        side stream -- so ``retire`` would block on nothing."""
        return (not self._chain and all(w.is_completed() for w in self.works)
                and all(event_done(e) for e in self.events))

    def retire(self) -> None:
        """``wait`` for what has ``landed``: its callbacks run now. Nothing is
        logged as waited for -- the host needed nothing: it released what it
        could (the estimator's schedule must not read this as a wait)."""
        self._wait_works(needed=False)
        self._run_callbacks()

    def _run_callbacks(self) -> None:
        callbacks, self.then = self.then, []
        for callback in callbacks:
            callback()

    def _wait_works(self, needed: bool = True) -> None:
        self._landed, self.tickets = self.tickets, []
        if needed:
            comm_account().waiting(self._landed)
        works, self.works = self.works, []
        events, self.events = self.events, []
        if works or events:
            start = time.perf_counter()
            wait_works(works, self.peers, self.group, self.label, self.timeout_s)
            for event in events:
                wait_event(event)
            comm_account().add_wait(self.kind or "other", time.perf_counter() - start)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def counted(kind: str, size: int, group: dist.ProcessGroup, transport: Transport, stream: SideStream | None,
         async_op: bool, issue: Callable[[bool], Pending]) -> Pending:
    """Count, label and launch one collective; ``issue(async_op)`` enqueues it.
    On a side stream the launch is synchronous *to that stream* (the host does
    not block) and an event marks its end."""
    ticket = comm_account().add(kind, size, dim_name(group), group.size())
    with record_function(f"flatfsdp::{kind}"):
        if stream is None or stream.stream is None:
            pending = issue(async_op)
            if not async_op:  # the host held until it landed
                comm_account().waiting([ticket])
        else:
            pending, event = stream.launch(lambda: issue(False))
            pending.events = [event]
        pending.tickets = [ticket]
        pending.label = f"({kind})"
        pending.timeout_s = transport.timeout_s
        pending.kind = kind
        return pending


def algorithm(group: dist.ProcessGroup, transport: Transport) -> str:
    """How gathers and reduce-scatters run over ``group``: "native" everywhere
    but gloo; on gloo the transport's choice (FLATFSDP_GLOO_ALGORITHM, default
    "exchange": Note [gloo exchange] in exchange.py; "all_reduce" all-reduces
    gradients and keeps the local slice)."""
    return transport.algorithm(dist.get_backend(group))


def _handles(group: dist.ProcessGroup, *works: "dist.Work | None") -> Pending:
    return Pending([w for w in works if w is not None], group=group)


def _messages(group: dist.ProcessGroup, pairs: list, then: list | None = None) -> Pending:
    return Pending([w for w, _ in pairs], then=then or [], peers=[p for _, p in pairs], group=group)


def all_gather(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, transport: Transport,
               async_op: bool = False, stream: SideStream | None = None, kind: str = "all_gather") -> Pending:
    """Gather equal shards into ``output``, rank-major. ``shard`` may be
    ``output``'s own slice: in-place gathers need no staging copy. ``kind``:
    the account's name for it (a row lookup's ids are not weights)."""
    if algorithm(group, transport) == "exchange":
        return counted(kind, nbytes(output), group, transport, None, async_op,
                    lambda _: _messages(group, exchange_all_gather(output, shard, group)))
    return counted(kind, nbytes(output), group, transport, stream, async_op,
                lambda a: _handles(group, all_gather_single(output, shard, group=group, async_op=a)))


def gather_pieces(pieces: list[tuple[torch.Tensor, torch.Tensor]], group: dist.ProcessGroup, size: int,
                  transport: Transport, async_op: bool = False, stream: SideStream | None = None) -> Pending:
    """Several equal-shard all-gathers that together fill one buffer of ``size``
    bytes (counted once): ``(output, shard)`` pairs, each rank-major."""
    def issue(a: bool) -> Pending:
        return _handles(group, *(all_gather_single(out, shard, group=group, async_op=a)
                                 for out, shard in pieces))
    return counted("all_gather", size, group, transport, stream, async_op, issue)


def exchange(kind: str, size: int, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]],
             group: dist.ProcessGroup, transport: Transport, then: list[Callable[[], None]] | None = None) -> Pending:
    """Point-to-point messages that together implement one collective of
    ``size`` bytes (counted as ``kind``); see exchange.post_messages. ``then``
    runs once they have landed (a reduction's summation)."""
    return counted(kind, size, group, transport, None, True,
                lambda _: _messages(group, post_messages(sends, recvs, group), then))


def reduce_scatter(output: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup, transport: Transport,
                   async_op: bool = False, stream: SideStream | None = None) -> Pending:
    """Sum ``flat`` over the group; this rank's equal slice lands in ``output``.
    ``flat`` may be overwritten (it is a transient gradient buffer)."""
    chosen = algorithm(group, transport)
    if chosen == "exchange":
        return counted("reduce_scatter", nbytes(flat), group, transport, None, async_op,
                    lambda _: _messages(group, *exchange_reduce_scatter(output, flat, group)))
    if chosen == "all_reduce":
        pending = all_reduce(flat, group, transport, async_op)
        shard = flat.numel() // group.size()
        mine = flat[group.rank() * shard:(group.rank() + 1) * shard]
        if not same_start(mine, output):
            pending.then.append(lambda: output.copy_(mine))
        return pending
    return counted("reduce_scatter", nbytes(flat), group, transport, stream, async_op,
                lambda a: _handles(group, reduce_scatter_single(output, flat, op=dist.ReduceOp.SUM,
                                                                     group=group, async_op=a)))


def all_reduce(flat: torch.Tensor, group: dist.ProcessGroup, transport: Transport, async_op: bool = False,
               stream: SideStream | None = None, kind: str = "all_reduce") -> Pending:
    """Sum ``flat`` over the group, in place. Kept as gloo's own all-reduce even
    where gathers are exchanges: replicas must end bitwise equal, which one
    collective guarantees and per-rank sums in different orders would not."""
    return counted(kind, nbytes(flat), group, transport, stream, async_op,
                lambda a: _handles(group, dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=a)))


def dim_name(group: dist.ProcessGroup) -> str:
    """The mesh dimension a group was made for (DeviceMesh describes each
    group as ``mesh_<dim>``); "world" for a group of every rank."""
    desc = getattr(group, "group_desc", "") or ""
    if desc.startswith("mesh_"):
        return desc[len("mesh_"):]
    if group.size() == dist.get_world_size():
        return "world"
    return desc or getattr(group, "group_name", "group")
