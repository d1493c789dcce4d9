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

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from flatfsdp.engine import copy_to_host


class StagingBuffers:
    """Host memory that async saves copy into, kept from one save to the next.

    Pass the same object to every ``save(..., async_save=True, staging=...)``
    of a training loop: from the second save on, the copy writes into the
    pages the first one touched (same entries, same shapes) instead of fresh
    ones -- first-touch page faults cost several times the copy itself
    (docs/checkpoints.md has the figures). Holds this rank's share of the
    checkpoint in host memory between saves; drop the object to free it.
    Never in use by two writes at once: a save first waits for the one in
    flight.
    """

    def __init__(self) -> None:
        self._kept: dict = {}
        self._plan: tuple | None = None
        """(signature, this rank's final plan, rank 0's global metadata) of the last save."""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._kept.values())

    def _claim(self, keys: list, sources: list[torch.Tensor]) -> list[torch.Tensor | None]:
        out = []
        for key, source in zip(keys, sources):
            kept = self._kept.get(key)
            fits = kept is not None and kept.shape == source.shape and kept.dtype == source.dtype
            out.append(kept if fits else None)
        return out

    def _keep(self, keys: list, copies: list[torch.Tensor]) -> None:
        self._kept = dict(zip(keys, copies))  # entries this save did not write are let go

    def _cached_plan(self, signature: tuple):
        """(plan, metadata) of the last save when its state dict had this very layout."""
        if self._plan is not None and self._plan[0] == signature:
            return self._plan[1:]
        return None

    def _remember_plan(self, signature: tuple, plan, metadata) -> None:
        self._plan = (signature, plan, metadata)


def layout_signature(flat: dict) -> tuple:
    """What DCP's save plan depends on, entry by entry: names, global shapes,
    dtypes, and for DTensors their placements and mesh (with this rank's
    place in it, they fix the local chunk). Values do not matter."""
    out = []
    for name, value in flat.items():
        if isinstance(value, DTensor):
            out.append((name, tuple(value.shape), value.dtype, tuple(value.placements), value.device_mesh))
        elif isinstance(value, torch.Tensor):
            out.append((name, tuple(value.shape), value.dtype))
        else:
            out.append((name, None))
    return tuple(out)


class StagingSavePlanner(DefaultSavePlanner):
    def __init__(self) -> None:
        super().__init__()
        self._staged: dict | None = None
        """MetadataIndex -> host tensor (or the pickled bytes of a plain value); None: not staged."""

    def stage(self, plan: SavePlan, buffers: StagingBuffers | None = None) -> int:
        """Copy this rank's share of ``plan`` (its final local plan) to host
        memory -- into ``buffers`` where they fit, pinned where it comes from an
        accelerator; returns the bytes copied. Non-tensor values are pickled
        now, as DCP would at write time."""
        tensors = [item for item in plan.items if item.type != WriteItemType.BYTE_IO]
        keys = [item.index for item in tensors]
        sources = [super(StagingSavePlanner, self).resolve_data(item) for item in tensors]
        copies = copy_to_host(sources, buffers._claim(keys, sources) if buffers is not None else None)
        if buffers is not None:
            buffers._keep(keys, copies)
        staged: dict = dict(zip(keys, copies))
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
