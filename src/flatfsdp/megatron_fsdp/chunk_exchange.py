"""The collectives of uneven DTensors: what every rank of a block of a mesh
holds (its local shapes, a picklable record), and the data itself.

Both go one mesh dimension at a time, over that dimension's process group,
carrying what the previous steps collected: after the last step every rank
has the record (or the data) of every rank that shares its coordinates on the
dimensions not stepped over -- its *block*. One call is one collective per
dimension, whatever it carries, so a caller batches every tensor of a state
dict into one record.

Data travels padded to the largest part of each step and is cut back after:
gloo's all-gather takes equal sizes only (NCCL's would take unequal ones).
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from flatfsdp.megatron_fsdp.chunk_boxes import Box, Shape


def mesh_coords(mesh: DeviceMesh) -> dict[int, Shape]:
    """Every rank of the mesh -> its coordinate (from the mesh's rank table)."""
    table = mesh.mesh
    return {int(table[idx]): idx for idx in itertools.product(*map(range, table.shape))}


def block_coords(mesh: DeviceMesh, dims: Sequence[int]) -> dict[int, Shape]:
    """The ranks of this rank's block (same coordinates outside ``dims``)."""
    everyone = mesh_coords(mesh)
    mine = everyone[dist.get_rank()]
    kept = [d for d in range(mesh.ndim) if d not in dims]
    return {r: c for r, c in everyone.items() if all(c[d] == mine[d] for d in kept)}


def gather_records(mesh: DeviceMesh, dims: Sequence[int], record: Any) -> dict[int, Any]:
    """Every block rank's ``record`` (rank -> record): one all_gather_object per dimension."""
    held = {dist.get_rank(): record}
    for d in sorted(dims):
        group = mesh.get_group(d)
        parts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, held, group=group)
        held = {rank: rec for part in parts for rank, rec in part.items()}
    return held


def gather_parts(local: torch.Tensor, mesh: DeviceMesh, dims: Sequence[int],
                 boxes: dict[int, Box]) -> dict[int, torch.Tensor]:
    """Every block rank's local data, flat (rank -> tensor), given every rank's
    box (so each step knows how much each peer sends). A rank without a box
    sends nothing."""
    coords = block_coords(mesh, dims)
    held_ranks = [dist.get_rank()]
    flat = local.detach().contiguous().reshape(-1)
    stepped: list[int] = []
    for d in sorted(dims):
        group = mesh.get_group(d)
        peers = dist.get_process_group_ranks(group)
        if peers != sorted(peers):  # torch's groups list their ranks in ascending order; the layout relies on it
            raise RuntimeError(f"the process group of mesh dimension {d} lists its ranks as {peers}, not ascending")
        peer_ranks = [_held_order(coords, p, stepped) for p in peers]
        stepped.append(d)
        sizes = [sum(_numel(boxes.get(r)) for r in ranks) for ranks in peer_ranks]
        padded = torch.zeros(max(sizes + [1]), dtype=flat.dtype, device=flat.device)
        padded[:flat.numel()] = flat
        received = [torch.empty_like(padded) for _ in peers]
        dist.all_gather(received, padded, group=group)
        flat = torch.cat([buf[:n] for buf, n in zip(received, sizes)])
        held_ranks = [r for ranks in peer_ranks for r in ranks]
    return _split(flat, held_ranks, boxes)


def _held_order(coords: dict[int, Shape], rank: int, stepped: list[int]) -> list[int]:
    """The ranks whose data ``rank`` holds after stepping over ``stepped``, in
    the order it concatenated them (each step: its line's ranks, ascending)."""
    if not stepped:
        return [rank]
    *earlier, d = stepped
    mine = coords[rank]
    line = sorted(r for r, c in coords.items() if all(c[i] == mine[i] for i in range(len(c)) if i != d))
    return [x for r in line for x in _held_order(coords, r, earlier)]


def _numel(box: Box | None) -> int:
    if box is None:
        return 0
    n = 1
    for s in box.sizes:
        n *= s
    return n


def _split(flat: torch.Tensor, ranks: list[int], boxes: dict[int, Box]) -> dict[int, torch.Tensor]:
    parts, start = {}, 0
    for r in ranks:
        n = _numel(boxes.get(r))
        if boxes.get(r) is not None:
            parts[r] = flat[start:start + n].view(boxes[r].sizes)
        start += n
    return parts


def assemble(shape: Shape, parts: dict[int, torch.Tensor], boxes: dict[int, Box], like: torch.Tensor) -> torch.Tensor:
    """The whole tensor, each part put in its box (replicas write the same values)."""
    full = torch.zeros(shape, dtype=like.dtype, device=like.device)
    for rank, part in parts.items():
        box = boxes[rank]
        full[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))] = part
    return full
