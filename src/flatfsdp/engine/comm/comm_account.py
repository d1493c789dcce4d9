"""The user-visible communication account: how many collectives of each kind
ran, and how many bytes their buffers covered, on this rank -- in total and
per mesh dimension (``by_dim()``: HSDP's shard and outer traffic apart) --
and the bytes of the point-to-point messages this rank posted, per peer
(``sent_by_peer()``: what crosses a link between nodes, see Note [sent bytes]),
and how long the host waited for collectives to land (``waited()``: the
communication the schedule did not hide behind compute). A listener
(``listening``) also receives the schedule itself: each collective issued,
posted and waited for, by ticket (comm/schedule_log.py)."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import defaultdict
from typing import Callable, Iterator

from flatfsdp.engine.comm.schedule_log import Follows, Issued, Posted, Waited


class CommAccount:
    """Counts per collective kind. ``bytes`` is the size of the full (unsharded)
    buffer each collective covers, so it can be compared with model sizes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self._by_dim: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        self._sent: dict[int, int] = defaultdict(int)
        self._waited: dict[str, float] = defaultdict(float)
        self._tickets = itertools.count()
        self._listener: Callable[[object], None] | None = None

    def add(self, kind: str, nbytes: int, dim: str = "world", group_size: int = 0, paced: bool = False) -> int:
        """``dim``: the mesh dimension the collective ran over; ``paced``: its
        bytes are posted later, slice by slice (``posted``). Returns its ticket."""
        with self._lock:
            for entry in (self._counts[kind], self._by_dim[dim, kind]):
                entry[0] += 1
                entry[1] += nbytes
            ticket = next(self._tickets)
        self._tell(lambda: Issued(ticket, kind, nbytes, dim, group_size, paced))
        return ticket

    def posted(self, ticket: int, nbytes: int) -> None:
        """A slice of ``nbytes`` of paced collective ``ticket`` went to the transport."""
        self._tell(lambda: Posted(ticket, nbytes))

    def waiting(self, tickets: list[int]) -> None:
        """The host needs these collectives' results now (the schedule; ``add_wait`` times it)."""
        if tickets:
            self._tell(lambda: Waited(tuple(tickets)))

    def follows(self, tickets: list[int], after: list[int]) -> None:
        """``tickets`` were issued once ``after`` had landed (a chained stage)."""
        if tickets and after:
            self._tell(lambda: Follows(tuple(tickets), tuple(after)))

    def _tell(self, record: Callable[[], object]) -> None:
        listener = self._listener
        if listener is not None:
            listener(record())

    @contextlib.contextmanager
    def listening(self, listener: Callable[[object], None]) -> Iterator[None]:
        """Hand ``listener`` every schedule record (comm/schedule_log.py) until
        the block ends; one listener at a time."""
        if self._listener is not None:
            raise RuntimeError("the communication account already has a schedule listener")
        self._listener = listener
        try:
            yield
        finally:
            self._listener = None

    def add_sent(self, peer: int, nbytes: int) -> None:
        """A message of ``nbytes`` posted to global rank ``peer``."""
        with self._lock:
            self._sent[peer] += nbytes

    def add_wait(self, kind: str, seconds: float) -> None:
        """The host blocked ``seconds`` waiting for a collective of ``kind`` to land."""
        with self._lock:
            self._waited[kind] += seconds

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()
            self._by_dim.clear()
            self._sent.clear()
            self._waited.clear()

    def by_dim(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{dimension: {kind: {"count", "bytes"}}}``; a dimension is the mesh
        dimension's name (``dp_shard``, ``dp_outer``, ...), "world" for a group
        of every rank."""
        with self._lock:
            out: dict[str, dict[str, dict[str, int]]] = {}
            for (dim, kind), (c, b) in sorted(self._by_dim.items()):
                out.setdefault(dim, {})[kind] = {"count": c, "bytes": b}
            return out

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {kind: {"count": c, "bytes": b} for kind, (c, b) in sorted(self._counts.items())}

    def sent_by_peer(self) -> dict[int, int]:
        """``{global rank: bytes this rank sent it}`` in point-to-point messages."""
        with self._lock:
            return dict(sorted(self._sent.items()))

    def waited(self) -> dict[str, float]:
        """``{kind: seconds}`` the host spent blocked on collectives of each kind:
        exposed communication (a wait that finds the result landed costs ~0)."""
        with self._lock:
            return dict(sorted(self._waited.items()))

    def total_bytes(self) -> int:
        return sum(entry["bytes"] for entry in self.snapshot().values())


# Note [sent bytes]
# A collective's buffer size says nothing about which link its bytes take.
# Where the engine moves bytes itself -- gloo's pairwise exchanges
# (exchange.py) -- it knows each message's peer, so it records the payload per
# peer; whoever knows which ranks share a node (torchrun's LOCAL_WORLD_SIZE,
# read by the application) splits that into intra- and inter-node bytes. The
# engine keeps no notion of nodes. Native collectives (gloo's all_reduce,
# NCCL's anything) route bytes inside the backend, out of the engine's sight:
# they appear here only per kind and dimension, never per peer.

_ACCOUNT = CommAccount()


def comm_account() -> CommAccount:
    """The process-wide account (one per rank)."""
    return _ACCOUNT
