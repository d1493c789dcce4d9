"""A Hugging Face checkpoint directory: which safetensors file holds each tensor.

Either one ``model.safetensors`` or several shards named by
``model.safetensors.index.json`` (``{"metadata": ..., "weight_map": {name:
file}}``, the layout ``save_pretrained`` writes above its shard size). The
index is untrusted input: every file it names must sit in the directory, and
every tensor it names must be in that file's header.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from flatfsdp.checkpoint.errors import CheckpointError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Entry:
    file: str
    """Path of the safetensors file holding the tensor."""
    dtype: torch.dtype
    shape: tuple[int, ...]


def _weight_map(directory: str) -> dict[str, str] | None:
    """name -> path from the index; None where the directory holds one file."""
    index = os.path.join(directory, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
        except (ValueError, AttributeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: no weight_map of tensor names to file names")
        for name in set(weight_map.values()):
            if os.path.basename(name) != name or name in ("", ".", ".."):
                raise CheckpointError(f"{index}: file {name!r} is not a file name in {directory}")
        return {key: os.path.join(directory, name) for key, name in weight_map.items()}
    single = os.path.join(directory, SINGLE)
    if os.path.isfile(single):
        return None
    others = sorted(n for n in os.listdir(directory) if n.endswith((".bin", ".pt", ".pth", ".safetensors")))
    hint = f" (found {', '.join(others)}; only safetensors checkpoints are read)" if others else ""
    raise CheckpointError(f"{directory}: neither {SINGLE} nor {INDEX}{hint}")


def checkpoint_entries(path) -> dict[str, Entry]:
    """Every tensor of the checkpoint at ``path`` (a directory, or one .safetensors
    file): its file, dtype and shape, from the headers (no tensor data is read)."""
    from flatfsdp.checkpoint.safetensors_format import SafetensorsFile

    path = os.fspath(path)
    if os.path.isfile(path):
        directory, single, weight_map = os.path.dirname(path), path, None
    elif os.path.isdir(path):
        directory, single = path, os.path.join(path, SINGLE)
        weight_map = _weight_map(directory)
    else:
        raise CheckpointError(f"{path}: no such file or directory")
    if weight_map is None:
        header = SafetensorsFile(single).entries
        return {name: Entry(single, dtype, shape) for name, (dtype, shape, _b, _e) in header.items()}
    entries = {}
    for file in sorted(set(weight_map.values())):
        if not os.path.isfile(file):
            raise CheckpointError(f"{os.path.join(directory, INDEX)} names {os.path.basename(file)}, "
                                  "which is not in the directory")
        header = SafetensorsFile(file).entries
        for name in (k for k, v in weight_map.items() if v == file):
            if name not in header:
                raise CheckpointError(f"{file}: the index puts {name!r} here but the file does not hold it")
            dtype, shape, _b, _e = header[name]
            entries[name] = Entry(file, dtype, shape)
    return entries
