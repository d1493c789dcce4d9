"""Which part of a parameter's full value this rank holds, read off its DTensor
placements -- the only thing a loader needs to know about the sharding.

``Shard(d)`` on a mesh dimension of size k splits dimension d the way
``torch.chunk`` does (chunks of ceil(n / k) rows, trailing ones shorter or
empty), applied mesh dimension by mesh dimension; ``Replicate()`` keeps the
whole range. flatfsdp's DTensors never lie (docs/placements.md), so this is
exactly what each local tensor holds; the loader still checks the shape.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_region(tensor: torch.Tensor) -> tuple[slice, ...]:
    """The slice of the full (global) value that this rank's local tensor holds."""
    ranges = [(0, n) for n in tensor.shape]
    if not isinstance(tensor, DTensor):
        return tuple(slice(a, b) for a, b in ranges)
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this rank is not in the parameter's device mesh")
    for mesh_dim, placement in enumerate(tensor.placements):
        if placement.is_partial():
            raise ValueError(f"a Partial placement holds no slice of the value: {tensor.placements}")
        if not placement.is_shard():
            continue
        dim = placement.dim % tensor.dim()
        start, stop = ranges[dim]
        chunk = -(-(stop - start) // mesh.size(mesh_dim))
        lo = min(start + coordinate[mesh_dim] * chunk, stop)
        ranges[dim] = (lo, min(lo + chunk, stop))
    return tuple(slice(a, b) for a, b in ranges)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Where this rank's values live (the DTensor's local tensor, a plain tensor itself)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def region_shape(region: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in region)
