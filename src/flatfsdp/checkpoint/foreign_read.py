"""Reading DCP checkpoints flatfsdp did not write (Megatron-LM's torch_dist and fsdp_dtensor).

They carry no manifest, so nothing vouches for their bytes: every data file the
metadata names must exist and hold every byte range the metadata points into
(a truncated or missing file is an error naming it, before anything is read),
the metadata itself goes through the same allowlisting unpickler as ours
(safe_read.py), and pickled values are read inertly (inert_pickle.py): nothing
a checkpoint names is imported or run.

Tensors are read by region: a caller asks for ``(key, offsets, sizes)`` boxes of
a global tensor and gets plain tensors of exactly those sizes -- one layer of
Megatron's layer-stacked tensors, half of a fused SwiGLU weight -- whatever the
chunks the saving ranks wrote, so a conversion never holds more than the
boxes it is writing.
"""

from __future__ import annotations

import io
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from flatfsdp.checkpoint import inert_pickle
from flatfsdp.checkpoint.errors import CheckpointError, unwrap_dcp_errors
from flatfsdp.checkpoint.safe_read import METADATA_NAME, VerifiedReader


@dataclass(frozen=True)
class Region:
    """The box ``[offsets, offsets + sizes)`` of the global tensor saved under ``key``."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class _RegionPlanner(LoadPlanner):
    """Reads the requested boxes into tensors of their own size; bytes entries stay raw bytes."""

    def __init__(self, regions: list[Region], byte_keys: list[str]):
        self.regions, self.byte_keys = regions, byte_keys
        self.tensors: dict[tuple, torch.Tensor] = {}
        self.raw: dict[str, bytes] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        for region in self.regions:
            entry = self.metadata.state_dict_metadata[region.key]
            chunk = ChunkStorageMetadata(offsets=torch.Size(region.offsets), sizes=torch.Size(region.sizes))
            self.tensors[(region.key, tuple(region.offsets))] = torch.empty(region.sizes,
                                                                            dtype=entry.properties.dtype)
            items += create_read_items_for_chunk_list(region.key, entry, [chunk])
        for key in self.byte_keys:
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key),
                                  dest_offsets=torch.Size(()), storage_index=MetadataIndex(key),
                                  storage_offsets=torch.Size(()), lengths=torch.Size(())))
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.raw[read_item.dest_index.fqn] = value.read()

    def resolve_tensor(self, read_item):
        dest = self.tensors[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, start, length)
        return dest

    def commit_tensor(self, read_item, tensor) -> None:
        pass  # resolve_tensor handed out a view of the destination: the read already landed there


class ForeignCheckpoint:
    """One DCP directory written by another program, opened for reading only."""

    def __init__(self, directory: str, *, check_files: bool = True):
        """``check_files`` False: the metadata alone, to tell what the folder is before vouching for it."""
        self.directory = directory
        self.reader = VerifiedReader(directory, expected_sha256=None, listed=None)
        self.metadata = self.reader.read_metadata()
        if check_files:
            self.check_files()

    @property
    def entries(self) -> dict:
        return self.metadata.state_dict_metadata

    def tensor_keys(self) -> list[str]:
        return [k for k, v in self.entries.items() if isinstance(v, TensorStorageMetadata)]

    def object_keys(self) -> list[str]:
        return [k for k, v in self.entries.items() if isinstance(v, BytesStorageMetadata)]

    def check_files(self) -> None:
        """Every byte the metadata points into is there (no hashes exist to check more)."""
        needed: dict[str, int] = {}
        for info in (self.metadata.storage_data or {}).values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, end in sorted(needed.items()):
            path = os.path.join(self.directory, name)
            if not os.path.isfile(path):
                raise CheckpointError(f"{path}: missing, but the checkpoint's {METADATA_NAME} reads from it")
            if os.path.getsize(path) < end:
                raise CheckpointError(f"{path}: truncated ({os.path.getsize(path)} bytes; the checkpoint's "
                                      f"{METADATA_NAME} reads up to byte {end})")

    def _read(self, regions: list[Region], byte_keys: list[str]) -> _RegionPlanner:
        return _read(self.reader, self.directory, self.entries, regions, byte_keys)

    def read_regions(self, regions: list[Region]) -> list[torch.Tensor]:
        """One tensor per region, in order (two regions of one key must not start at the same offsets)."""
        planner = self._read(regions, [])
        return [planner.tensors[(r.key, tuple(r.offsets))] for r in regions]

    def read_tensor(self, key: str) -> torch.Tensor:
        size = tuple(self.entries[key].size)
        return self.read_regions([Region(key, (0,) * len(size), size)])[0]

    def read_objects(self, keys: list[str]) -> dict:
        """The pickled values under ``keys``, read inertly (Note [inert unpickling])."""
        return read_objects(self.reader, self.directory, keys)


def _read(reader, directory: str, entries: dict, regions: list[Region], byte_keys: list[str]) -> _RegionPlanner:
    for key in [r.key for r in regions] + list(byte_keys):
        if key not in entries:
            raise CheckpointError(f"{directory} holds no entry {key!r}")
    planner = _RegionPlanner(list(regions), list(byte_keys))
    with unwrap_dcp_errors(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: intended
        dcp.load({}, storage_reader=reader, planner=planner, no_dist=True)
    return planner


def read_objects(reader, directory: str, keys: list[str]) -> dict:
    """The pickled values under ``keys`` of the checkpoint ``reader`` reads, read inertly -- also
    for a checkpoint of flatfsdp's (a converted one keeps Megatron-LM's argument namespace)."""
    entries = reader.read_metadata().state_dict_metadata
    raw = _read(reader, directory, entries, [], keys).raw
    return {key: inert_pickle.loads(raw[key], f"{directory}: entry {key!r}") for key in keys}
