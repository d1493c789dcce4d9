"""Gradient reductions of one root, from the end of each unit's backward to
the optimizer step: coalesced when small, asynchronous, bounded in number.

A unit's reduction is issued as soon as its backward ends, unless it is small:
then it waits in an open bucket (with others of the same kind, dtype, groups
and codec: ``ReduceRequest.bucket_key``) until the bucket is full, someone needs its result, or the backward
ends. At most ``max_in_flight`` issued reductions are outstanding; each holds
an unsharded gradient buffer, so this bounds the memory backward can take.

Every rank submits the same requests in the same order, so every rank issues
the same collectives in the same order.
"""

from __future__ import annotations

from collections import deque

from torch.autograd.profiler import record_function

from flatfsdp.engine.comm import coalesce
from flatfsdp.engine.comm.coalesce import ReduceRequest
from flatfsdp.engine.comm.collectives import Pending
from flatfsdp.engine.layout.device import SideStream


FOLLOW_UP_SLACK = 2
"""Follow-ups (HSDP's and HFSDP's outer stage) in flight beyond the first-stage bound."""


class ReductionQueue:
    def __init__(self, *, bucket_bytes: int, max_in_flight: int, stream: SideStream | None = None):
        self.bucket_bytes = bucket_bytes
        self.max_in_flight = max_in_flight
        self.stream = stream
        self._open: dict[tuple, list[ReduceRequest]] = {}
        self._in_flight: deque[Pending] = deque()

    def submit(self, request: ReduceRequest) -> None:
        self.poll()
        if request.nbytes >= self.bucket_bytes:
            self._issue([request])
            return
        key = request.bucket_key
        bucket = self._open.get(key)
        if bucket and sum(r.nbytes for r in bucket) + request.nbytes > self.bucket_bytes:
            self._issue(self._open.pop(key))
        self._open.setdefault(key, []).append(request)
        request.flush = self.flush

    def flush(self) -> None:
        """Issue every open bucket."""
        while self._open:
            self._issue(self._open.pop(next(iter(self._open))))

    def poll(self) -> None:
        """Issue the chained follow-ups (HSDP's all-reduce across replicas,
        HFSDP's outer reduce-scatter) of reductions that have landed, oldest
        first and never past one that has not: every rank starts them in the
        same order, so they pair up across ranks whatever each rank's timing."""
        self._retire_landed()
        for pending in self._in_flight:
            if pending.chained and not self._room_for_a_follow_up():
                break  # issued later, in order, once an older one is delivered
            pending.advance()
            if pending.chained:
                break
        self._retire_landed()

    def _retire_landed(self) -> None:
        """Deliver the oldest reductions that have landed, every stage of
        them, in issue order: what they hold is released now, not when
        backward ends. Under HFSDP each unit's inner-reduced chunk (fp32,
        1/S of the unit) otherwise lived on beside every later unit's until
        the optimizer step -- 4 P/S at the end of backward. Delivery is this
        rank's own business (no collective), so ranks need not agree on when."""
        while self._in_flight and self._in_flight[0].landed():
            self._in_flight.popleft().retire()

    def drain_until(self, target: Pending) -> None:
        """Before ``target``'s follow-ups start, every older reduction's have."""
        if not any(pending is target for pending in self._in_flight):
            return  # waited for already: nothing older is owed
        for pending in self._in_flight:
            if pending is target:
                return
            while pending.chained:
                pending.next_stage()

    def wait_all(self) -> None:
        with record_function("flatfsdp::wait_reductions"):
            self.flush()
            while self._in_flight:
                self._in_flight.popleft().wait()

    def _issue(self, members: list[ReduceRequest]) -> None:
        for member in members:
            member.flush = None
        pending = coalesce.reduce(members, async_op=True, stream=self.stream)
        for member in members:
            member.drain = lambda: self.drain_until(pending)
        self._in_flight.append(pending)
        # Only first stages hold an unsharded gradient buffer: they are what
        # this bound limits. A reduction whose follow-up travels (a slow outer
        # link) holds a shard-sized result: a looser bound of its own
        # (``_room_for_a_follow_up``).
        while sum(not p.followed for p in self._in_flight) > self.max_in_flight:
            self._free_a_slot()

    def _room_for_a_follow_up(self) -> bool:
        """A follow-up holds its input, the first stage's shard-sized result
        (HFSDP's inner-reduced fp32 chunk), until delivered: bounded too, a
        little looser than first stages, so a slower outer link may lag
        FOLLOW_UP_SLACK units behind before backward waits for it (FSDP2's
        HSDP waits for the previous unit's)."""
        return sum(p.followed for p in self._in_flight) < self.max_in_flight + FOLLOW_UP_SLACK

    def _free_a_slot(self) -> None:
        """Move the oldest first stage on: issue its follow-up (everything older
        has issued theirs: order kept), or wait for it if it has none."""
        for pending in self._in_flight:
            if not pending.followed:
                if pending.chained:
                    while not self._room_for_a_follow_up():
                        # The oldest are the followed ones (follow-ups start in order).
                        self._in_flight.popleft().wait()
                    pending.next_stage()
                else:
                    pending.wait()
                    self._in_flight.remove(pending)
                return
