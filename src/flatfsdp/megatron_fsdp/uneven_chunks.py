"""A DTensor that says where its local part lies: what makes an uneven
DTensor honest to torch's distributed checkpoint.

torch's DCP asks a DTensor for its part's offsets (``__create_chunk_list__``,
``__create_write_items__``) and, by default, computes them from the placements
with torch's ``Shard`` rule -- wrong for a DTensor whose parts are uneven.
Stock Megatron-FSDP sets closures answering those two names on the DTensor's
local tensor. Here the DTensor's own class answers them instead: it becomes
a subclass of its class with ``UnevenChunks`` in front (the engine's
``swap_class``, as a sharded module's class is swapped), holding its part's
box -- or, until a collective has found it, nothing yet (*pending*: a DCP
call on it then raises, naming the fix, rather than running a collective
inside DCP's planning, where ranks need not call in the same order).

``full_tensor()`` gathers by the boxes (torch's would read the placements
with its even rule); a copy (``copy.deepcopy``, pickle) is a plain DTensor:
the box belongs to this object's part, not to a copy's.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from flatfsdp.engine import swap_class
from flatfsdp.megatron_fsdp.chunk_boxes import Box, sharded_dims
from flatfsdp.megatron_fsdp.chunk_exchange import assemble, block_coords, gather_parts, gather_records
from flatfsdp.megatron_fsdp.part_records import BOX, NESTING, Resolution, box_of, is_uneven, record_of, resolve


class UnevenChunks:
    """Put in front of a DTensor's class by ``mark``; see the module's note."""

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        box = known_box(self)
        return [ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        box = known_box(self)
        local = self._local_tensor
        if local.numel() == 0:
            return []  # an empty part writes nothing; the others cover the tensor
        chunk = ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))
        return [WriteItem(type=WriteItemType.SHARD, index=MetadataIndex(fqn, chunk.offsets),
                          tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(
                              local), size=self.size()))]

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        return whole_tensor(self, "full_tensor")

    def __deepcopy__(self, memo: dict) -> DTensor:
        return plain_copy(self, memo)

    def __reduce_ex__(self, protocol: int):
        return plain_copy(self, {}).__reduce_ex__(protocol)


def over(local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int],
         stride: Sequence[int]) -> DTensor:
    """A DTensor of global ``shape`` whose local part is ``local`` itself (the
    same storage: what a checkpoint loads into it lands there)."""
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return DTensor(local, spec, requires_grad=False)


def mark(dtensor: DTensor, box: Box | None, nesting: tuple[int, ...] | None = None) -> DTensor:
    """Make ``dtensor`` say its part's ``box`` (None: pending). ``nesting``:
    its sharded mesh dimensions, innermost first, where they differ from torch's
    reading of its placements (kept for the collective that finds the box)."""
    swap_class(dtensor, UnevenChunks)
    state = vars(dtensor)  # the swapped class's own state, as a sharded module keeps its own
    state[BOX] = box
    if nesting is not None or NESTING not in state:
        state[NESTING] = nesting
    return dtensor


def known_box(dtensor: DTensor) -> Box:
    box = box_of(dtensor)
    if box is None:
        raise RuntimeError(
            f"this uneven DTensor (shape {tuple(dtensor.shape)}, placements {dtensor.placements}) does not know "
            "where its part lies yet: run flatfsdp.megatron_fsdp.uneven_dtensor.preprocess_state_dict_for_uneven_"
            "dtensor(state_dict) on every rank (or update_uneven_dtensor_chunk_metadata on it) before a checkpoint "
            "reads it")
    return box


def plain(dtensor: DTensor) -> DTensor:
    """The same part (the same storage) and spec as a plain DTensor."""
    return DTensor(dtensor._local_tensor, dtensor._spec, requires_grad=False)


def plain_copy(dtensor: DTensor, memo: dict) -> DTensor:
    """What a copy or a pickle of a swapped DTensor is: a plain DTensor over a
    copy of its part (a Parameter stays one), with the instance's other
    attributes copied as torch copies them -- its box stays behind."""
    out = DTensor(dtensor._local_tensor.detach().clone(), dtensor._spec, requires_grad=False)
    if isinstance(dtensor, torch.nn.Parameter):
        out = torch.nn.Parameter(out, requires_grad=dtensor.requires_grad)
    state = {k: v for k, v in vars(dtensor).items() if k not in (BOX, NESTING, "_is_param")}
    vars(out).update(copy.deepcopy(state, memo))
    return out


def resolved(dtensor: Any, caller: str) -> Resolution:
    """Where every part lies (a collective over the DTensor's sharded mesh
    dimensions); parts that do not tile the tensor are refused, on every rank alike."""
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"{caller}: expected a DTensor, got {type(dtensor).__name__}")
    mesh, dims = dtensor.device_mesh, sharded_dims(dtensor.placements)
    resolution = resolve(gather_records(mesh, dims, record_of(dtensor)), block_coords(mesh, dims))
    if resolution.problems:
        raise ValueError(f"{caller}: the parts of this DTensor (shape {tuple(dtensor.shape)}, placements "
                         f"{dtensor.placements}) do not tile it: {'; '.join(resolution.problems)}")
    return resolution


def whole_tensor(dtensor: Any, caller: str) -> torch.Tensor:
    """The whole tensor on every rank of the DTensor's mesh (collectives):
    torch's gather where the parts follow its rule, else by the boxes."""
    resolution = resolved(dtensor, caller)
    if resolution.even:
        return (plain(dtensor) if is_uneven(dtensor) else dtensor).full_tensor()
    mesh, dims = dtensor.device_mesh, sharded_dims(dtensor.placements)
    parts = gather_parts(dtensor._local_tensor, mesh, dims, resolution.boxes)
    return assemble(tuple(dtensor.shape), parts, resolution.boxes, dtensor._local_tensor)
