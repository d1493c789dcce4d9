"""The few collectives checkpoint save/load need, and their no-process-group form.

Every rank-0-only step (recovering, publishing) runs through `run_on_coordinator`
so that a failure there raises the same error on every rank instead of leaving
the other ranks waiting in the next collective.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

from flatfsdp.checkpoint.errors import CheckpointError


class Coordination:
    """Rank/world of ``group`` (default: the world); a lone process when no process
    group is initialised or ``no_dist`` asks for one (DCP's flag of the same name)."""

    def __init__(self, group=None, *, no_dist: bool = False):
        self.distributed = not no_dist and dist.is_available() and dist.is_initialized()
        if self.distributed:
            _require_numpy()
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def gather(self, value: Any) -> list:
        if not self.distributed:
            return [value]
        out = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out

    def gather_to_coordinator(self, value: Any) -> list | None:
        """Every rank's ``value``, in rank order, on rank 0 (None elsewhere)."""
        if not self.distributed:
            return [value]
        out = [None] * self.world if self.is_coordinator else None
        dist.gather_object(value, out, group=self.group, group_dst=0)
        return out

    def scatter_from_coordinator(self, values: list | None) -> Any:
        """Rank 0's ``values[r]`` on rank r (``values`` is read on rank 0 only)."""
        if not self.distributed:
            return values[0]
        box = [None]
        dist.scatter_object_list(box, values if self.is_coordinator else None, group=self.group, group_src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def run_on_coordinator(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on rank 0; its result, or its error as CheckpointError, on every rank."""
        outcome: tuple[bool, Any] = (True, None)
        if self.is_coordinator:
            try:
                outcome = (True, fn())
            except (OSError, CheckpointError) as exc:
                outcome = (False, str(exc))
        ok, value = self.broadcast(outcome)
        if not ok:
            raise CheckpointError(value)
        return value

    def raise_first(self, error: str | None) -> None:
        """Raise the lowest rank's error on every rank (each rank passes its own or None)."""
        errors = [e for e in self.gather(error) if e]
        if errors:
            raise CheckpointError(errors[0])


def _require_numpy() -> None:
    """DCP agrees on its save/load plans with object collectives, which torch
    implements with numpy; say so up front instead of failing mid-save."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        raise CheckpointError("checkpoints over a process group need numpy (torch.distributed.checkpoint "
                              "exchanges its plans with object collectives, which torch builds on numpy): "
                              "pip install 'flatfsdp[checkpoint]'") from None
