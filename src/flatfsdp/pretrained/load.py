"""Fill a (sharded) model from a pretrained safetensors checkpoint, each rank
reading only the bytes of its own shards.

Per tensor: map its file (no read), cut this rank's region out of the map (a
view: still no read), and ``copy_`` it into the rank's local tensor -- which
reads exactly those pages and converts to the main-weight dtype on the way.
No full tensor is built, nothing is broadcast, no rank waits for another.
What the loader itself holds beyond the model is the pages of the current
file it touched (its own rows) plus, for a tensor whose file offset does not
suit its dtype, one copy of that tensor: docs/pretrained.md has the bound.
Files are processed one at a time and dropped after, releasing their pages.

The writes go into the local tensors of the sharded parameters in place; the
engine sees in-place writes (version counters), and ``mark_initialized`` both
says so explicitly and drops a meta-built model's deferred initialisation,
which would otherwise overwrite the loaded values on first use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import groupby
from typing import Callable

import torch

from flatfsdp.engine import mark_initialized
from flatfsdp.checkpoint.errors import CheckpointError
from flatfsdp.pretrained.files import checkpoint_entries
from flatfsdp.pretrained.names import model_targets, plan
from flatfsdp.pretrained.regions import local_region, local_tensor, region_shape


@dataclass(frozen=True)
class LoadReport:
    """What one rank's load did (figures are this rank's)."""

    tensors: int
    """Model tensors filled (a tied weight counts once)."""
    files: int
    """Safetensors files this rank opened."""
    bytes_read: int
    """Checkpoint bytes copied into this rank's shards: its regions, in the file's dtype."""
    largest_read_bytes: int
    """The largest single region read."""
    temporary_bytes: int
    """The largest temporary the loader allocated (a copy of a misaligned tensor; else 0)."""
    rewrite: tuple[str, str]
    """(prefix stripped from model names, prefix added) to get checkpoint names; ("", "") if none."""
    unexpected: tuple[str, ...]
    """Checkpoint tensors nothing in the model took (an error unless strict=False)."""


def load_pretrained(model: torch.nn.Module, path, *, strict: bool = True,
                    skip: Callable[[str], bool] | None = None) -> LoadReport:
    """Fill every parameter and persistent buffer of ``model`` from the
    safetensors checkpoint at ``path`` -- a Hugging Face directory
    (``model.safetensors``, or shards with ``model.safetensors.index.json``) or
    one ``.safetensors`` file.

    ``model`` may be sharded by either front door (possibly built on the meta
    device: its deferred initialisation is dropped) or a plain module on a real
    device. Values are converted to each parameter's dtype (the main-weight
    dtype of a sharded model). Names may differ by a prefix (see names.py).
    Tensors the model has but the checkpoint lacks, and shape differences, raise
    CheckpointError listing them; so do checkpoint tensors the model lacks,
    unless ``strict=False``. ``skip(name)`` true: that tensor is not the
    checkpoint's to fill (e.g. LoRA adapters, which the caller initialises
    itself); it is left as it is. Every rank of a sharded model calls this; no
    collective is involved.
    """
    path = os.fspath(path)
    entries = checkpoint_entries(path)
    targets, unfillable = model_targets(model)
    if skip is not None:
        targets = [t for t in targets if not any(skip(n) for n in t.names)]
    if unfillable:
        raise CheckpointError(f"buffers {', '.join(unfillable)} are on the meta device and not saved in "
                              "checkpoints (non-persistent): build the model with them on a real device")
    matched = plan(targets, {name: entry.shape for name, entry in entries.items()})
    problems = matched.problems(strict)
    if problems:
        raise CheckpointError(f"{path} does not match the model: {problems}")
    with torch.no_grad():
        meta = [t.names[0] for t, _ in matched.sources if local_tensor(t.tensor).is_meta]
    if meta:
        raise CheckpointError(f"{', '.join(meta[:8])} are on the meta device and not sharded by flatfsdp: shard "
                              "the model first (each rank then holds real storage for its shard), or build it "
                              "on a real device")
    with torch.no_grad():
        figures = _copy_all(matched.sources, entries)
    mark_initialized(model)
    return LoadReport(tensors=len(matched.sources), rewrite=matched.rewrite, unexpected=tuple(matched.unexpected),
                      **figures)


def _copy_all(sources, entries) -> dict:
    totals = {"bytes_read": 0, "largest_read_bytes": 0, "temporary_bytes": 0, "files": 0}
    by_file = sorted(sources, key=lambda s: entries[s[1]].file)
    for file_path, members in groupby(by_file, key=lambda s: entries[s[1]].file):
        read, largest, temporary = _copy_file(file_path, list(members))
        totals["bytes_read"] += read
        totals["largest_read_bytes"] = max(totals["largest_read_bytes"], largest)
        totals["temporary_bytes"] = max(totals["temporary_bytes"], temporary)
        totals["files"] += 1
    return totals


def _copy_file(file_path: str, members) -> tuple[int, int, int]:
    """Copy each member's region out of one file. Every view of the file's map
    dies with this frame, and the map and its pages with them."""
    from flatfsdp.checkpoint.safetensors_format import SafetensorsFile

    file = SafetensorsFile(file_path)
    read = largest = temporary = 0
    for target, name in members:
        region = local_region(target.tensor)
        local = local_tensor(target.tensor)
        if tuple(local.shape) != region_shape(region):
            raise CheckpointError(f"{name}: the local shard is {tuple(local.shape)}, its placements "
                                  f"say {region_shape(region)}")
        source = file.tensor(name)
        if not file.is_aligned(name):
            temporary = max(temporary, source.numel() * source.element_size())
        piece = source[region]
        local.copy_(piece)
        nbytes = piece.numel() * piece.element_size()
        read, largest = read + nbytes, max(largest, nbytes)
    return read, largest, temporary
