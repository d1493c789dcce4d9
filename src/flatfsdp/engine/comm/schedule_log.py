"""What the engine issues and waits for, in order: the records a time model
replays (flatfsdp.estimator.timeline) instead of keeping a copy of the
schedule by hand.

Each collective gets a ticket when it is counted (``CommAccount.add``); the
records name tickets, so a wait says exactly which collectives the host
blocked on, and a chained stage (HSDP's all-reduce after the reduce-scatter)
says which it had to follow. Nothing is recorded unless someone listens
(``CommAccount.listening``): a training step pays one attribute test per
collective.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Issued:
    """A collective handed to the transport (all its bytes, unless ``paced``)."""
    ticket: int
    kind: str
    """The account's kind: all_gather, reduce_scatter, all_reduce, rows, ..."""
    nbytes: int
    """The full buffer it covers (the account's unit)."""
    dim: str
    """The mesh dimension it runs over ("world": every rank)."""
    group_size: int
    paced: bool = False
    """Its bytes are posted later, slice by slice (``Posted``)."""


@dataclass(frozen=True)
class Posted:
    """A slice of a paced collective posted to the transport."""
    ticket: int
    nbytes: int


@dataclass(frozen=True)
class Waited:
    """The host needed these collectives' results before going on."""
    tickets: tuple[int, ...]


@dataclass(frozen=True)
class Follows:
    """Collectives issued only once earlier ones had landed (a chained stage)."""
    tickets: tuple[int, ...]
    after: tuple[int, ...]
