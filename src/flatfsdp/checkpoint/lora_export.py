"""`flatfsdp checkpoint export --format hf` of a LoRA run (`flatfsdp train --lora-rank`).

Such a checkpoint holds the frozen model under PEFT's names
(``<layer>.base_layer.weight``), the adapters (``<layer>.lora_A.default.weight``,
``<layer>.lora_B.default.weight``) and the adapter settings as the
``lora_config`` entry. The export writes both things a user may want:

* ``OUT/``: the merged model -- each wrapped weight ``W + (alpha / r) B A``
  under its plain name, with config.json -- which
  ``AutoModelForCausalLM.from_pretrained(OUT)`` loads with no PEFT at all;
* ``OUT/adapter/``: the adapters alone as a PEFT folder (adapter_config.json,
  adapter_model.safetensors), for ``PeftModel.from_pretrained(base, OUT/adapter)``.

One weight (with its two adapters) is in memory at a time. The folder
appears complete or not at all.
"""

from __future__ import annotations

import json
import math
import os

import torch

from flatfsdp.checkpoint.errors import CheckpointError
from flatfsdp.checkpoint.export import _load_batch, _select
from flatfsdp.checkpoint.export_folder import building
from flatfsdp.checkpoint.hf_companions import write_companions, write_json
from flatfsdp.checkpoint.safetensors_format import SafetensorsStreamWriter

LORA_CONFIG_ENTRY = "lora_config"
"""Checkpoint entry holding the PEFT adapter config as a JSON string."""
ADAPTER = "default"
_WRAPPED = ".base_layer."


def read_lora_config(reader) -> dict:
    text = _load_batch(reader, [(LORA_CONFIG_ENTRY, LORA_CONFIG_ENTRY, None)])[LORA_CONFIG_ENTRY]
    try:
        config = json.loads(text)
        config["r"], config["lora_alpha"]  # noqa: B018 -- both must be there
    except (TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{reader.path}: entry {LORA_CONFIG_ENTRY!r} is not a LoRA config ({exc})") from None
    return config


def _scale(config: dict) -> float:
    rank = config["r"]
    return config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _plan(metadata, prefix: str, tied_output: str | None):
    """(base key, output name, meta, adapter A key or None, adapter B key or None) per model
    tensor, and (adapter key, PEFT name, meta) per adapter tensor."""
    tensors = {key: md for key, _name, md in _select(metadata, prefix) if md is not None}
    merged, adapters = [], []
    for key, md in tensors.items():
        name = key[len(prefix):]
        if ".lora_A." in name or ".lora_B." in name:
            peft_name = "base_model.model." + name.replace(f".{ADAPTER}.", ".")
            adapters.append((key, peft_name, md))
            continue
        if _WRAPPED in name:
            layer = key.split(_WRAPPED)[0]
            a, b = f"{layer}.lora_A.{ADAPTER}.weight", f"{layer}.lora_B.{ADAPTER}.weight"
            wrapped = name.endswith(".base_layer.weight") and a in tensors and b in tensors
            merged.append((key, name.replace(_WRAPPED, "."), md, a if wrapped else None, b if wrapped else None))
        elif name != tied_output:
            merged.append((key, name, md, None, None))
    return merged, adapters


@torch.no_grad()
def _write_merged(path: str, reader, entries: dict, merged, scale: float) -> int:
    specs = [(name, md.properties.dtype, tuple(md.size)) for _key, name, md, _a, _b in merged]
    with open(path, "wb") as f:
        writer = SafetensorsStreamWriter(f, specs)
        for key, name, md, a, b in merged:
            loaded = _load_batch(reader, [(k, k, entries[k]) for k in (key, a, b) if k is not None])
            weight = loaded[key]
            if a is not None:
                delta = loaded[b].double() @ loaded[a].double()
                weight = (weight.double() + scale * delta).to(weight.dtype)
            writer.write(name, weight)
        writer.close()
        f.flush()
        os.fsync(f.fileno())
    return sum(md.size.numel() * md.properties.dtype.itemsize for _k, _n, md, _a, _b in merged)


def _write_adapters(folder: str, reader, adapters, config: dict) -> None:
    os.makedirs(folder)
    specs = [(name, md.properties.dtype, tuple(md.size)) for _key, name, md in adapters]
    loaded = _load_batch(reader, [(key, key, md) for key, _name, md in adapters])
    with open(os.path.join(folder, "adapter_model.safetensors"), "wb") as f:
        writer = SafetensorsStreamWriter(f, specs)
        for key, name, _md in adapters:
            writer.write(name, loaded.pop(key))
        writer.close()
    write_json(os.path.join(folder, "adapter_config.json"), config)


def export_lora_hf(reader, metadata, out_dir: str, hf_config: dict, prefix: str, tied_output: str) -> dict:
    """See the module docstring; ``out_dir`` is absolute and checked absent or empty."""
    config = read_lora_config(reader)
    merged, adapters = _plan(metadata, prefix, tied_output if hf_config.get("tie_word_embeddings") else None)
    if not adapters or not any(a for *_rest, a, _b in merged):
        raise CheckpointError(f"{reader.path} has a {LORA_CONFIG_ENTRY!r} entry but no adapters under {prefix!r}")
    dtypes = {str(md.properties.dtype).removeprefix("torch.") for _k, _n, md, _a, _b in merged}
    if len(dtypes) == 1 and next(iter(dtypes)) in ("float32", "bfloat16", "float16"):
        hf_config["dtype"] = dtypes.pop()
        hf_config.pop("torch_dtype", None)
    with building(out_dir) as partial:
        total = _write_merged(os.path.join(partial, "model.safetensors"), reader, metadata.state_dict_metadata,
                              merged, _scale(config))
        write_json(os.path.join(partial, "config.json"), hf_config)
        companions = write_companions(reader, metadata, partial, hf_config)
        _write_adapters(os.path.join(partial, "adapter"), reader, adapters, config)
    return {"tensors": len(merged), "bytes": total, "files": 1, "adapters": len(adapters), **companions}
