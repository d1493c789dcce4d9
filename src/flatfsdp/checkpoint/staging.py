"""DCP's default save planner, able to take its own copy of what this rank writes.

An async save (Note [async saves], async_save.py) plans on the live state dict
-- DTensors carry the mesh and placements DCP needs -- and then `stage` copies
exactly the items of this rank's final plan into host memory: after DCP's
deduplication a replicated value is copied by the one rank that writes it.
From then on the write reads only those copies, so training may change the
live tensors while the files are written.
"""

from __future__ import annotations

import io

from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from flatfsdp.engine import copy_to_host


class StagingSavePlanner(DefaultSavePlanner):
    def __init__(self) -> None:
        super().__init__()
        self._staged: dict | None = None
        """MetadataIndex -> host tensor (or the pickled bytes of a plain value); None: not staged."""

    def stage(self, plan: SavePlan) -> int:
        """Copy this rank's share of ``plan`` (its final local plan) to host
        memory, pinned where it comes from an accelerator; returns the bytes
        copied. Non-tensor values are pickled now, as DCP would at write time."""
        tensors = [item for item in plan.items if item.type != WriteItemType.BYTE_IO]
        copies = copy_to_host([super(StagingSavePlanner, self).resolve_data(item) for item in tensors])
        staged: dict = {item.index: copy for item, copy in zip(tensors, copies)}
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                staged[item.index] = super().resolve_data(item).getvalue()
        self._staged = staged
        self.state_dict = {}  # the write must never read the live values again
        return sum(c.nbytes for c in copies)

    def resolve_data(self, write_item: WriteItem):
        if self._staged is None:
            return super().resolve_data(write_item)
        value = self._staged[write_item.index]
        return io.BytesIO(value) if isinstance(value, bytes) else value
