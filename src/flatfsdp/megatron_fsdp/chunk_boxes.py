"""Where each rank's part of an uneven DTensor lies: arithmetic over local
shapes and a mesh's rank table, no communication.

A DTensor whose local parts do not follow torch's ``Shard`` rule (stock
Megatron-FSDP's flat-buffer chunks; one SwiGLU half of a chunk of flatfsdp's)
names its placements but not where each part starts. Megatron-FSDP's reading,
kept here: the parts are nested boxes. Along each sharded mesh dimension, from
the innermost out, the parts of the ranks that differ only in that coordinate
lie side by side, in coordinate order, along the placement's tensor dimension;
together they make the box the next dimension out arranges in turn.

Which mesh dimension is innermost (``innermost_first``): the order a mesh
names (stock sets ``_shard_order`` on the meshes it builds: outermost first),
else torch's, where placements nest left to right -- the last sharded mesh
dimension is innermost, a ``_StridedShard`` inside all the others. (Stock's own
default reads plain placements the other way round, so it misplaces the parts
of a torch-even ``(Shard(0), Shard(0))`` DTensor; for DTensors whose parts do
follow torch's rule, callers use torch's own offsets, not these.)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from torch.distributed.tensor.placement_types import Placement, Shard, _StridedShard

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Box:
    """One rank's part: where it starts and how large it is, per tensor dimension."""

    offsets: Shape
    sizes: Shape


@dataclasses.dataclass(frozen=True)
class Layout:
    """Every rank's part (``boxes``; a rank that holds no entry has none) and,
    when the parts do not tile the whole tensor exactly, what is wrong."""

    boxes: dict[int, Box]
    problems: tuple[str, ...] = ()


def sharded_dims(placements: Sequence[Placement]) -> tuple[int, ...]:
    """The mesh dimensions that split the tensor (the rest hold replicas)."""
    return tuple(d for d, p in enumerate(placements) if isinstance(p, (Shard, _StridedShard)))


def innermost_first(placements: Sequence[Placement], shard_order: Sequence[int] | None = None) -> tuple[int, ...]:
    """The sharded mesh dimensions, innermost first (see the module's note)."""
    sharded = sharded_dims(placements)
    if shard_order is not None:
        return tuple(d for d in reversed(tuple(shard_order)) if d in sharded)
    strided = [d for d in sharded if isinstance(placements[d], _StridedShard)]
    return tuple(strided + [d for d in reversed(sharded) if d not in strided])


def nested_boxes(shape: Shape, placements: Sequence[Placement], order: Sequence[int],
                 coords: dict[int, Shape], locals_: dict[int, Shape | None]) -> Layout:
    """Every rank's box, for the ranks of ``coords`` (rank -> mesh coordinate);
    ``locals_[rank]`` is its local shape, None where it holds no entry (its part
    counts as empty: a rank whose optimizer keeps no state for a parameter).
    ``order``: the sharded mesh dimensions, innermost first."""
    extent = {r: list(s) if s is not None else None for r, s in locals_.items()}
    offsets = {r: [0] * len(shape) for r in coords}
    problems: list[str] = []
    for mesh_dim in order:
        dim = placements[mesh_dim].dim
        for members in _lines(coords, mesh_dim):
            present = [r for r in members if extent.get(r) is not None]
            problems += _disagreement(present, extent, dim, mesh_dim)
            running = 0
            for r in present:
                offsets[r][dim] += running
                running += extent[r][dim]
            whole = None if not present else [*extent[present[0]][:dim], running, *extent[present[0]][dim + 1:]]
            for r in members:
                extent[r] = list(whole) if whole is not None else None
    problems += _coverage(shape, coords, extent, locals_)
    boxes = {r: Box(tuple(offsets[r]), tuple(s)) for r, s in locals_.items() if s is not None and r in coords}
    return Layout(boxes, tuple(dict.fromkeys(problems)))


def _lines(coords: dict[int, Shape], mesh_dim: int) -> list[list[int]]:
    """The ranks that differ only in ``mesh_dim``, each line in coordinate order."""
    lines: dict[Shape, list[int]] = {}
    for rank, c in coords.items():
        lines.setdefault(c[:mesh_dim] + c[mesh_dim + 1:], []).append(rank)
    return [sorted(line, key=lambda r: coords[r][mesh_dim]) for _, line in sorted(lines.items())]


def _disagreement(present: list[int], extent: dict, dim: int, mesh_dim: int) -> list[str]:
    """Parts laid side by side along ``dim`` must agree on every other dimension."""
    others = {r: tuple(s for i, s in enumerate(extent[r]) if i != dim) for r in present}
    if len(set(others.values())) <= 1:
        return []
    shown = ", ".join(f"rank {r}: {tuple(extent[r])}" for r in present)
    return [f"the parts along mesh dimension {mesh_dim} differ outside tensor dimension {dim} ({shown})"]


def _coverage(shape: Shape, coords: dict[int, Shape], extent: dict, locals_: dict) -> list[str]:
    """After the outermost dimension every rank's box of boxes must be the whole tensor."""
    found = []
    missing = sorted(r for r in coords if locals_.get(r) is None)
    for rank in sorted(coords):
        whole = extent.get(rank)
        if whole is None or tuple(whole) != tuple(shape):
            held = ", ".join(f"rank {r}: {tuple(s)}" for r, s in sorted(locals_.items()) if s is not None)
            lacking = f"; ranks {missing} hold no entry" if missing else ""
            found.append(f"the parts ({held}{lacking}) make {tuple(whole) if whole else 'nothing'}, "
                         f"not the global shape {tuple(shape)}")
            break
    return found


def flat_range(shape: Shape, box: Box) -> slice | None:
    """The box as one range of the row-major flattened tensor, or None where
    its elements are not one contiguous run (a part cut out of the middle of
    a row dimension other than the first it spans)."""
    numel = math.prod(box.sizes)
    if numel == 0:
        start = sum(o * math.prod(shape[i + 1:]) for i, o in enumerate(box.offsets))
        return slice(start, start)
    first = next((i for i, s in enumerate(box.sizes) if s != 1), len(shape))
    full_after = all(box.offsets[i] == 0 and box.sizes[i] == shape[i] for i in range(first + 1, len(shape)))
    if not full_after:
        return None
    start = sum(o * math.prod(shape[i + 1:]) for i, o in enumerate(box.offsets))
    return slice(start, start + numel)
