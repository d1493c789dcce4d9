"""The gather codec of a group whose chunk is the whole group: a shard group
of one rank (world 1; HSDP replicas of one rank each) under ZeRO-3.

Nothing travels, so a compute-dtype copy of the chunk kept between steps --
what a gather sends from elsewhere -- would only hold a second copy of the
weights (2 bytes a parameter in bf16: 18 bytes instead of FSDP2's 16).
Computing in a narrower dtype than the main weights, each gather casts the
main weights into the unsharded buffer instead, as FSDP2's all-gather casts
its fp32 shard: one pass over the unit per gather, and the memory is the
unit's gathered weights only while it computes. In one dtype the unsharded
buffer is the main weights themselves (``in_place``): no copy at all, and
nothing gathered comes and goes.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from flatfsdp.engine.comm.collectives import Pending
from flatfsdp.engine.layout import views
from flatfsdp.engine.layout.arithmetic import GroupLayout
from flatfsdp.engine.layout.device import SideStream
from flatfsdp.engine.layout.switches import Transport


class CastGather:
    """The gather codec (comm/wire.py) of a group held whole by this rank."""

    travels_alone = True
    whole_chunk = True
    """What callers ask of a codec: is every byte it gathers already on this rank."""

    def __init__(self, layout: GroupLayout, unsharded: torch.Tensor, main_chunk: Callable[[int], torch.Tensor],
                 transport: Transport, in_place: bool = False):
        """``main_chunk(i)``: parameter i's main weights (the whole parameter here);
        ``in_place``: they are the unsharded buffer itself (one dtype): nothing to do."""
        if layout.world != 1:
            raise ValueError(f"a cast gather is for a chunk that is the whole group, not one of {layout.world}")
        self.layout, self.unsharded, self.transport = layout, unsharded, transport
        self._main_chunk, self.in_place = main_chunk, in_place

    @property
    def row_bytes(self) -> int:
        return self.layout.shard_numel * self.unsharded.element_size()

    @property
    def nbytes(self) -> int:
        return self.layout.unsharded_numel * self.unsharded.element_size()

    @property
    def device(self) -> torch.device:
        return self.unsharded.device

    @property
    def dtype(self) -> torch.dtype:
        return self.unsharded.dtype

    def refresh(self) -> None:
        """Nothing kept to bring up to date: every gather reads the main weights."""

    def refresh_early(self) -> None:
        pass

    def local_result(self) -> Pending:
        """The cast, run where the unit waits for its weights (on its compute stream)."""
        return Pending(label="(cast: the chunk is the whole group)", then=[] if self.in_place else [self._cast])

    def issue_alone(self, group: dist.ProcessGroup, *, async_op: bool, stream: SideStream | None) -> Pending:
        return self.local_result()

    def pack(self, row: torch.Tensor) -> None:
        raise RuntimeError("a cast gather is never packed: nothing travels")

    def unpack(self, table: torch.Tensor) -> None:
        raise RuntimeError("a cast gather is never packed: nothing travels")

    def release(self, keep_rows: bool) -> None:
        pass

    def held(self) -> list[torch.Tensor]:
        return []

    def _cast(self) -> None:
        params = self.layout.params
        with torch.no_grad():
            torch._foreach_copy_([views.unsharded_param(self.unsharded, p) for p in params],
                                 [self._main_chunk(i).view(p.shape) for i, p in enumerate(params)])
