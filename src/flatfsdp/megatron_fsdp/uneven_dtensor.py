"""megatron_fsdp 0.6.1's ``uneven_dtensor``: DTensors whose local parts do
not follow torch's ``Shard`` rule, for Megatron-LM's ``fsdp_dtensor``
checkpoints (docs/megatron.md, "Megatron-LM's checkpoints").

The same public functions and arguments as stock's, for any DTensor: torch's
even ones (flatfsdp's own parameters and optimizer state are even), stock's
uneven ones (its flat-buffer chunks; its meshes' ``_shard_order`` is read),
and the pieces ``split_dtensor`` and ``param_and_grad_buffer.make_fsdp_dtensor``
make. Where the parts lie is found from every rank's local shape
(part_records.py) with one collective per sharded mesh dimension; a DTensor
says it, for torch's checkpoint, through its class (uneven_chunks.py) --
nothing is set on torch's tensors.

Where it differs from stock: a DTensor whose parts follow torch's rule is read
with torch's offsets (stock misplaces the parts of a ``(Shard(0), Shard(0))``
DTensor); gathers work on gloo (parts of unequal size travel padded); parts that
do not tile the tensor are a ``ValueError`` naming the shapes (stock asserts,
or returns a wrong tensor); ``split_dtensor``'s pieces always say their part,
found from the DTensor's without another collective; and a whole state dict is
prepared in a few collectives that ranks holding different entries cannot
desynchronise (state_dict_chunks.py; stock's one collective per entry hangs
there, NVIDIA/Megatron-LM#4910).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.tensor import DTensor, Replicate

from flatfsdp.megatron_fsdp.chunk_boxes import Box
from flatfsdp.megatron_fsdp.part_records import is_uneven, my_box
from flatfsdp.megatron_fsdp.state_dict_chunks import dtensor_entries, get_unflattened_state_dict, prepare_state_dict
from flatfsdp.megatron_fsdp.uneven_chunks import mark, over, resolved, whole_tensor

__all__ = ["filter_unflattened_state_dict", "gather_and_compute_chunk_metadata", "gather_uneven_dtensor_to_full_tensor",
           "get_unflattened_state_dict", "preprocess_state_dict_for_uneven_dtensor",
           "redistribute_uneven_dtensor_to_replicated", "split_dtensor", "uneven_dtensor_to_full_tensor",
           "update_uneven_dtensor_chunk_metadata", "validate_uneven_dtensor"]


def gather_and_compute_chunk_metadata(dtensor: DTensor) -> ChunkStorageMetadata:
    """Where this rank's part lies (a collective over the DTensor's mesh)."""
    box = my_box(dtensor, resolved(dtensor, "gather_and_compute_chunk_metadata"))
    return ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))


def update_uneven_dtensor_chunk_metadata(dtensor: DTensor) -> None:
    """Make ``dtensor`` say where its part lies, for torch's checkpoint (a
    collective). A DTensor whose parts follow torch's rule is left as it is:
    torch already reads its offsets right."""
    resolution = resolved(dtensor, "update_uneven_dtensor_chunk_metadata")
    if resolution.even and not is_uneven(dtensor):
        return
    mark(dtensor, my_box(dtensor, resolution))


def validate_uneven_dtensor(dtensor: DTensor) -> None:
    """Check that the parts lie inside the tensor and tile it exactly (a
    collective); ``ValueError`` naming every rank's shape otherwise."""
    resolved(dtensor, "validate_uneven_dtensor")


def filter_unflattened_state_dict(state_dict: dict, key_chain: Sequence = (),
                                  visit_condition: Callable[[Any], bool] = lambda x: False) -> list[list]:
    """The key chains (lists of keys, through nested dicts) of the values that
    satisfy ``visit_condition``."""
    return dtensor_entries(state_dict, list(key_chain), visit_condition)


def preprocess_state_dict_for_uneven_dtensor(state_dict: dict) -> dict:
    """Make every DTensor of the (nested) state dict say where its part lies,
    for torch's checkpoint, in place; returns ``state_dict``. Every rank calls
    it (as Megatron-LM's save and load do); ranks may hold different entries
    (one rank's optimizer keeps no state for a parameter whose part is empty
    there). Parts that do not tile a tensor, or a rank of a mesh holding no
    entry on it, are one ``ValueError`` on every rank, nothing changed."""
    return prepare_state_dict(state_dict)


def uneven_dtensor_to_full_tensor(dtensor: DTensor) -> torch.Tensor:
    """The whole tensor, on every rank of the DTensor's mesh (a collective)."""
    return whole_tensor(dtensor, "uneven_dtensor_to_full_tensor")


def redistribute_uneven_dtensor_to_replicated(dtensor: DTensor) -> DTensor:
    """The whole tensor as a DTensor replicated over the same mesh (a collective)."""
    full = uneven_dtensor_to_full_tensor(dtensor)
    return DTensor.from_local(full, dtensor.device_mesh, [Replicate()] * dtensor.device_mesh.ndim, run_check=False)


def gather_uneven_dtensor_to_full_tensor(dtensor: DTensor) -> DTensor:
    """Stock's earlier name of ``redistribute_uneven_dtensor_to_replicated``."""
    return redistribute_uneven_dtensor_to_replicated(dtensor)


def split_dtensor(dtensor: DTensor, split_size_or_sections: int | list[int], dim: int = 0,
                  update_uneven_dtensor_chunk_meta: bool = False) -> Iterator[DTensor]:
    """Yield the DTensor's pieces along ``dim`` (as ``torch.split`` cuts the
    whole tensor), each over a view of this rank's part -- nothing is copied or
    moved between ranks. One collective finds where this rank's part lies; each
    piece then says its own part (``update_uneven_dtensor_chunk_meta`` is
    accepted: the pieces always do)."""
    bounds = _split_bounds(dtensor, split_size_or_sections, dim)
    own = my_box(dtensor, resolved(dtensor, "split_dtensor"))
    local = dtensor._local_tensor
    start, stop = own.offsets[dim], own.offsets[dim] + own.sizes[dim]
    for lo, hi in bounds:
        first, last = min(max(lo, start), hi), max(min(hi, stop), lo)
        length = max(last - first, 0)
        piece = local.narrow(dim, first - start if length else 0, length)
        shape = list(dtensor.shape)
        shape[dim] = hi - lo
        offsets = list(own.offsets)
        offsets[dim] = first - lo
        out = over(piece, dtensor.device_mesh, dtensor.placements, shape, _contiguous_stride(shape))
        yield mark(out, Box(tuple(offsets), tuple(piece.shape)))


def _split_bounds(dtensor: DTensor, split: int | list[int], dim: int) -> list[tuple[int, int]]:
    size = dtensor.shape[dim]
    if isinstance(split, int):
        if split <= 0:
            raise ValueError(f"split_dtensor: split size must be positive, got {split}")
        points = list(range(0, size, split)) + [size]
    else:
        if sum(split) != size or any(s < 0 for s in split):
            raise ValueError(f"split_dtensor: sections {list(split)} do not add up to the size {size} of "
                             f"dimension {dim} of a DTensor of shape {tuple(dtensor.shape)}")
        points = [0]
        for s in split:
            points.append(points[-1] + s)
    return list(zip(points, points[1:]))


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))

