"""Reading DCP files without trusting them.

Note [checkpoint pickles]
DCP stores two kinds of pickle: the ``.metadata`` file (always) and non-tensor
values such as ``step`` or optimizer hyper-parameters (inside ``.distcp``
files). Stock DCP unpickles both with plain ``pickle`` / ``torch.load(...,
weights_only=False)``, so a crafted checkpoint could run code on load. Here:

* ``.metadata`` is read once into memory, its sha256 checked against the
  manifest, and those same bytes (no second read, so no swap in between) are
  unpickled by an unpickler that only resolves DCP's own metadata classes,
  ``torch.Size``, dtypes, layouts and paths. Anything else is refused.
* non-tensor values go through ``torch.load(weights_only=True)``; tensors
  already do in DCP.

The manifest check on its own only catches corruption -- whoever can rewrite a
file can rewrite the manifest -- the allowlists are what stop code execution.
"""

from __future__ import annotations

import hashlib
import io
import os
import pathlib
import pickle

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import planner as dcp_planner
from torch.distributed.checkpoint.filesystem import _StorageInfo

from flatfsdp.checkpoint.errors import CheckpointError, weights_only_reason

METADATA_NAME = ".metadata"

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
                 "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
}
_ALLOWED.update({
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
})
# Megatron-Core's torch_dist writer also keeps its save plans in the metadata (to reuse them on the
# next save): DCP's own plain dataclasses and enum, read when flatfsdp converts such a checkpoint.
_ALLOWED.update({("torch.distributed.checkpoint.planner", name): getattr(dcp_planner, name)
                 for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")})
_ALLOWED.update({("pathlib", n): getattr(pathlib, n)
                 for n in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")})


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def load_metadata_bytes(raw: bytes, path: str) -> dcp_metadata.Metadata:
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # any unpickling failure means a bad file
        raise CheckpointError(f"{path}: refusing to load checkpoint metadata ({exc})") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{path}: not DCP metadata (holds {type(metadata).__name__})")
    return metadata


class VerifiedReader(FileSystemReader):
    """A FileSystemReader whose metadata is hash-checked and safely unpickled."""

    def __init__(self, path: str, expected_sha256: str | None, listed: frozenset[str] | None = None):
        super().__init__(path)
        self._directory = os.fspath(path)
        self._expected_sha256 = expected_sha256
        self._listed = listed
        """Files the manifest lists (and so were verified); None: not checked."""
        self._metadata_bytes: bytes | None = None

    def _verified_bytes(self) -> bytes:
        if self._metadata_bytes is None:
            path = os.path.join(self._directory, METADATA_NAME)
            if not os.path.isfile(path):
                raise CheckpointError(f"{self._directory} is not a DCP checkpoint: {METADATA_NAME} is missing")
            with open(path, "rb") as f:
                raw = f.read()
            if self._expected_sha256 is not None and hashlib.sha256(raw).hexdigest() != self._expected_sha256:
                raise CheckpointError(f"{path}: truncated or corrupted (sha256 differs from the manifest)")
            self._metadata_bytes = raw
        return self._metadata_bytes

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:  # flatfsdp never writes per-rank metadata files
            raise CheckpointError(f"{self._directory}: per-rank DCP metadata is not supported")
        metadata = load_metadata_bytes(self._verified_bytes(), os.path.join(self._directory, METADATA_NAME))
        self._check_listed(metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


    def _check_listed(self, metadata: dcp_metadata.Metadata) -> None:
        """Every data file the metadata reads from must be one the manifest lists
        (a manifest edited to drop a file would otherwise let it load unverified)."""
        if self._listed is None:
            return
        used = {getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()}
        unlisted = sorted(p for p in used if p is not None and p not in self._listed)
        if unlisted:
            raise CheckpointError(f"{self._directory}: {unlisted[0]} is read by the checkpoint but not listed in "
                                  "its manifest, so it cannot be verified (a tampered or mixed-up checkpoint)")


def _assign(root, path, value) -> None:
    for step in path[:-1]:
        root = root[step]
    root[path[-1]] = value


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor values load with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(f"checkpoint entry {fqn!r} is not a plain value; refusing to unpickle it "
                                  f"({weights_only_reason(exc)})") from None
        if self.flatten_state_dict:
            _assign(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
