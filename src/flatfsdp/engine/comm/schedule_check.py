"""Debug mode: do all ranks run the same units' collectives, in the same order?

A unit whose forward runs on some ranks only (routing, a branch on local data)
pairs its gather with another unit's on the other ranks; when the two happen
to be the same size nothing fails -- each rank computes with the other unit's
weights, silently. With ``FLATFSDP_CHECK_SCHEDULE=1`` the root records, per
step, the sequence of its unit collectives (each unit's forward gather, each
gradient reduction, by unit name) and at the step boundary the ranks compare
one 64-bit hash of it: one tiny all-gather per step. Only when the hashes
differ are the sequences exchanged, to name the first unit and rank that
diverge. Off by default: the check is a host sync per step.
"""

from __future__ import annotations

import hashlib
import os
import struct

import torch
import torch.distributed as dist

from flatfsdp.engine.comm.torch_collectives import all_gather_single

SCHEDULE_ENV = "FLATFSDP_CHECK_SCHEDULE"


class ScheduleMismatch(RuntimeError):
    """Ranks ran different unit collectives in one step."""



class ScheduleCheck:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._events: list[str] = []

    def record(self, event: str) -> None:
        if self.enabled:
            self._events.append(event)

    def recorded(self) -> tuple[str, ...]:
        """This step's unit collectives so far, in the order they were issued
        (empty unless the check is on); what the ranks will compare."""
        return tuple(self._events)

    def check(self, group: dist.ProcessGroup | None, step: int, device: torch.device) -> None:
        """Collective over ``group``: raise ScheduleMismatch on every rank unless
        all ranks recorded the same events since the last check."""
        events, self._events = self._events, []
        if not self.enabled or group is None or group.size() == 1:
            return
        digest = hashlib.sha256("\n".join(events).encode()).digest()
        mine = torch.tensor([struct.unpack("<q", digest[:8])[0]], dtype=torch.int64, device=device)
        hashes = torch.empty(group.size(), dtype=torch.int64, device=device)
        all_gather_single(hashes, mine, group=group)
        if bool((hashes == hashes[0]).all()):
            return
        everyone: list = [None] * group.size()
        dist.all_gather_object(everyone, events, group=group)
        raise ScheduleMismatch(_first_divergence(everyone, group, step))


def _first_divergence(everyone: list, group: dist.ProcessGroup, step: int) -> str:
    ranks = [dist.get_global_rank(group, r) for r in range(len(everyone))]
    reference = everyone[0]
    for index in range(max(len(e) for e in everyone)):
        mine = reference[index] if index < len(reference) else "nothing"
        differ = [(rank, e[index] if index < len(e) else "nothing") for rank, e in zip(ranks, everyone)
                  if (e[index] if index < len(e) else "nothing") != mine]
        if differ:
            rank, theirs = differ[0]
            others = ", ".join(str(r) for r, _ in differ)
            return (f"step {step}: ranks ran different unit collectives: collective #{index + 1} is {mine} on rank "
                    f"{ranks[0]} but {theirs} on rank {rank} (rank(s) {others} diverge from rank {ranks[0]}). "
                    "Every rank must run the same units' forwards and backwards in the same order; a unit "
                    "used on some ranks only pairs its collectives with another unit's")
    return f"step {step}: ranks ran different unit collectives"
