"""Consolidating a sharded checkpoint into one file of full tensors.

Tensors are loaded a batch at a time (a memory budget; a tensor larger than the
budget forms its own batch) into plain full-shape tensors -- DCP reassembles
every saved shard into them without a process group -- and streamed to the
output, so peak memory is about max(budget, largest tensor), not the model.
`.pt` output is the exception: torch.save needs the whole dict in memory.
"""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from flatfsdp.checkpoint.coordination import Coordination
from flatfsdp.checkpoint.errors import CheckpointError, unwrap_dcp_errors
from flatfsdp.checkpoint.safe_read import SafeLoadPlanner, VerifiedReader
from flatfsdp.checkpoint.safetensors_format import SafetensorsStreamWriter
from flatfsdp.checkpoint.open_any import open_any, refuse_torch_dist
from flatfsdp.checkpoint.save_load import quiet_no_dist

DEFAULT_BUDGET = 1 << 30


def _select(metadata, prefix: str) -> list[tuple[str, str, TensorStorageMetadata | None]]:
    """(checkpoint key, output name, tensor metadata or None for a non-tensor) under ``prefix``."""
    chosen = []
    for key in sorted(metadata.state_dict_metadata):
        if key.startswith(prefix):
            entry = metadata.state_dict_metadata[key]
            chosen.append((key, key[len(prefix):], entry if isinstance(entry, TensorStorageMetadata) else None))
    return chosen


def _batches(chosen, budget: int):
    batch, size = [], 0
    for item in chosen:
        md = item[2]
        nbytes = 0 if md is None else md.size.numel() * md.properties.dtype.itemsize
        if batch and size + nbytes > budget:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += nbytes
    if batch:
        yield batch


def _load_batch(reader: VerifiedReader, batch) -> dict:
    """Full tensors (and plain values) for one batch, keyed by checkpoint key."""
    state = {key: (None if md is None else torch.empty(md.size, dtype=md.properties.dtype))
             for key, _name, md in batch}
    with quiet_no_dist(Coordination(no_dist=True)), unwrap_dcp_errors():
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return state


def _write_safetensors(path: str, reader: VerifiedReader, tensors, budget: int) -> None:
    specs = [(name, md.properties.dtype, tuple(md.size)) for _key, name, md in tensors]
    with open(path, "wb") as f:
        writer = SafetensorsStreamWriter(f, specs)
        for batch in _batches(tensors, budget):
            loaded = _load_batch(reader, batch)
            for key, name, _md in batch:
                writer.write(name, loaded.pop(key))
        writer.close()
        f.flush()
        os.fsync(f.fileno())


def _consolidate(reader: VerifiedReader, chosen, budget: int) -> dict:
    out = {}
    for batch in _batches(chosen, budget):
        loaded = _load_batch(reader, batch)
        out.update({name: loaded[key] for key, name, _md in batch})
    return out


def export_checkpoint(directory, out_path, *, prefix: str | None = None, budget_bytes: int = DEFAULT_BUDGET) -> dict:
    """Write the entries of checkpoint ``directory`` whose key starts with ``prefix``
    to ``out_path`` (`.safetensors` or `.pt`), named without the prefix. ``prefix`` None:
    where the format keeps the model (``model.``; Megatron-LM's fsdp_dtensor: ``model.module.``).

    Runs in this process alone, also inside a distributed job (call it on one rank).
    ``prefix=""`` exports everything. Non-tensor entries go into `.pt` files only
    (safetensors holds tensors alone). The output appears atomically.
    Returns counts: ``{"tensors", "bytes", "objects", "skipped_objects"}``.
    """
    out_path = os.fspath(out_path)
    kind = os.path.splitext(out_path)[1]
    if kind not in (".safetensors", ".pt"):
        raise CheckpointError(f"{out_path}: output must end in .safetensors or .pt")
    opened = open_any(directory)
    refuse_torch_dist(opened, "export")
    reader = opened.reader
    prefix = opened.model_prefix if prefix is None else prefix
    chosen = _select(reader.read_metadata(), prefix)
    tensors = [c for c in chosen if c[2] is not None]
    if not tensors:
        raise CheckpointError(f"{opened.directory} holds no tensors under the prefix {prefix!r}")
    partial = f"{out_path}.partial"
    try:
        if kind == ".safetensors":
            _write_safetensors(partial, reader, tensors, budget_bytes)
        else:
            torch.save(_consolidate(reader, chosen, budget_bytes), partial)
        os.replace(partial, out_path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    objects = len(chosen) - len(tensors)
    written = objects if kind == ".pt" else 0
    return {"tensors": len(tensors), "objects": written, "skipped_objects": objects - written,
            "bytes": sum(md.size.numel() * md.properties.dtype.itemsize for _k, _n, md in tensors)}
