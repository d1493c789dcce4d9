"""What one rank tells the others about its part of a DTensor, and what the
block's records decide: where every part lies.

A record is small and picklable: the local shape, whether it is the shape
torch's ``Shard`` rule gives this rank, and the part's box where the DTensor
already says it (``uneven_chunks``). From every rank's record, identically on
every rank:

* every part says its box: those are the boxes;
* every rank holds a part and each is torch's shape: the DTensor is *even* --
  torch's own offsets are right (its placements are read as torch reads them,
  ``_StridedShard`` included), nothing needs saying;
* otherwise the parts are nested boxes (``chunk_boxes``), in the order the
  DTensor or its mesh names, else torch's; a rank without a record holds an
  empty part, and the boxes must tile the tensor exactly.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch.distributed as dist
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from flatfsdp.megatron_fsdp.chunk_boxes import Box, Shape, innermost_first, nested_boxes


BOX, NESTING = "_uneven_box", "_uneven_nesting"
"""Where an uneven DTensor keeps its part's box and nesting (uneven_chunks.mark sets them)."""


def is_uneven(value: object) -> bool:
    """A DTensor that says its part (whether or not it knows it yet)."""
    return isinstance(value, DTensor) and BOX in vars(value)


def box_of(dtensor: DTensor) -> Box | None:
    """The box it says (None: a plain DTensor, or pending)."""
    return vars(dtensor).get(BOX)


def nesting_of(dtensor: DTensor) -> tuple[int, ...] | None:
    return vars(dtensor).get(NESTING)


class Record(NamedTuple):
    shape: Shape
    torch_shape: bool
    """The local shape is the one torch's rule gives this rank."""
    box: Box | None
    whole: Shape
    """The DTensor's global shape (so any rank can check any entry)."""
    placements: tuple[Placement, ...]
    nesting: tuple[int, ...]
    """Its sharded mesh dimensions, innermost first (``nesting``)."""


@dataclasses.dataclass(frozen=True)
class Resolution:
    even: bool
    """torch's own offsets are right for every part (``boxes`` is then empty)."""
    boxes: dict[int, Box]
    problems: tuple[str, ...] = ()


def record_of(dtensor: DTensor) -> Record:
    shape = tuple(dtensor._local_tensor.shape)
    torch_shape, _ = compute_local_shape_and_global_offset(dtensor.shape, dtensor.device_mesh, dtensor.placements)
    return Record(shape, tuple(torch_shape) == shape, box_of(dtensor), tuple(dtensor.shape),
                  tuple(dtensor.placements), nesting(dtensor))


def resolve(records: dict[int, Record | None], coords: dict[int, Shape]) -> Resolution:
    """Where every part of one entry lies, from the block's ``records``
    (rank -> record; None or absent: the rank holds no entry)."""
    present = {r: rec for r, rec in records.items() if rec is not None and r in coords}
    if present and all(rec.box is not None for rec in present.values()):
        return Resolution(False, {r: rec.box for r, rec in present.items()})
    if len(present) == len(coords) and all(rec.torch_shape for rec in present.values()):
        return Resolution(True, {})
    first = next(iter(present.values()), None)
    if first is None:
        return Resolution(False, {}, ("no rank of the block holds it",))
    disagree = [f"rank {r}: {rec.whole} {rec.placements}" for r, rec in sorted(present.items())
                if (rec.whole, rec.placements) != (first.whole, first.placements)]
    if disagree:
        return Resolution(False, {}, (f"the ranks disagree on its global shape or placements ({'; '.join(disagree)}; "
                                      f"others: {first.whole} {first.placements})",))
    layout = nested_boxes(first.whole, first.placements, first.nesting, coords,
                          {r: (present[r].shape if r in present else None) for r in coords})
    return Resolution(False, layout.boxes, layout.problems)


def nesting(dtensor: DTensor) -> tuple[int, ...]:
    """The sharded mesh dimensions, innermost first: as the DTensor says, else
    as its mesh says (stock's ``_shard_order``, read, never set), else torch's."""
    own = nesting_of(dtensor)
    if own is not None:
        return own
    return innermost_first(dtensor.placements, getattr(dtensor.device_mesh, "_shard_order", None))


def my_box(dtensor: DTensor, resolution: Resolution) -> Box:
    """This rank's part's box."""
    if resolution.even:
        shape, offsets = compute_local_shape_and_global_offset(dtensor.shape, dtensor.device_mesh, dtensor.placements)
        return Box(tuple(offsets), tuple(shape))
    return resolution.boxes[dist.get_rank()]
