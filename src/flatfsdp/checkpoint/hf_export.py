"""Exporting a checkpoint as a Hugging Face model directory: ``config.json``
plus the weights as safetensors -- one ``model.safetensors``, or shards of at
most ``max_shard_bytes`` each with ``model.safetensors.index.json`` -- which
``transformers.AutoModelForCausalLM.from_pretrained`` loads.

The checkpoint's model entries already carry the transformers names (a model
trained with ``flatfsdp train --hf-model`` is the transformers module itself),
so the export is export.py's streamed writer run once per shard: peak memory
stays about max(budget, largest tensor). The config comes from the checkpoint
(``flatfsdp train --hf-model`` saves it as the ``hf_config`` entry) or from a
``config.json`` given by the caller. A tied output embedding is written once,
as ``save_pretrained`` does. Beside them go the tokenizer the run trained with
and generation_config.json (hf_companions.py). The directory appears complete
or not at all.
"""

from __future__ import annotations

import json
import os

from flatfsdp.checkpoint.errors import CheckpointError
from flatfsdp.checkpoint.export_folder import building, read_config_json
from flatfsdp.checkpoint.export import DEFAULT_BUDGET, _load_batch, _select, _write_safetensors
from flatfsdp.checkpoint.hf_companions import write_companions, write_json
from flatfsdp.checkpoint.lora_export import LORA_CONFIG_ENTRY, export_lora_hf
from flatfsdp.checkpoint.megatron_hf_export import export_megatron_gpt
from flatfsdp.checkpoint.open_any import open_any, refuse_torch_dist

CONFIG_ENTRY = "hf_config"
"""Checkpoint entry holding the model's config as a JSON string."""
DEFAULT_MAX_SHARD = 4 << 30
TIED_OUTPUT = "lm_head.weight"
_DTYPE_NAMES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def _read_config(reader, metadata, config) -> dict:
    if config is not None:
        return read_config_json(config)
    if CONFIG_ENTRY not in metadata.state_dict_metadata:
        raise CheckpointError(f"{reader.path} holds no {CONFIG_ENTRY!r} entry (saved by flatfsdp train --hf-model): "
                              "pass the model's config.json (--config)")
    text = _load_batch(reader, [(CONFIG_ENTRY, CONFIG_ENTRY, None)])[CONFIG_ENTRY]
    try:
        loaded = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{reader.path}: entry {CONFIG_ENTRY!r} is not a JSON config ({exc})") from None
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{reader.path}: entry {CONFIG_ENTRY!r} is not a JSON object")
    return loaded


MEGATRON_CORE_NAMES = ("embedding.word_embeddings.weight", "decoder.layers.", "decoder.final_layernorm.")
"""Names only a Megatron-Core model has: its checkpoint is exported as GPT-2 (megatron_gpt_hf.py)."""


def _nbytes(item) -> int:
    return item[2].size.numel() * item[2].properties.dtype.itemsize


def _shards(tensors, limit: int) -> list[list]:
    """Consecutive tensors packed into files of at most ``limit`` bytes (a larger tensor alone)."""
    files, current, size = [], [], 0
    for item in tensors:
        nbytes = _nbytes(item)
        if current and size + nbytes > limit:
            files.append(current)
            current, size = [], 0
        current.append(item)
        size += nbytes
    return files + [current] if current else files


def export_hf(directory, out_dir, *, config=None, prefix: str | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD,
              budget_bytes: int = DEFAULT_BUDGET) -> dict:
    """Write checkpoint ``directory``'s entries under ``prefix`` (named without it)
    as a Hugging Face model directory ``out_dir``, which must not exist or be
    empty. ``config``: a config.json (or a directory holding one) to use instead
    of the checkpoint's own. A LoRA checkpoint (a ``lora_config`` entry) is
    written merged, with its adapters in ``out_dir/adapter`` (lora_export.py).
    Returns ``{"tensors", "bytes", "files", "tokenizer", "tokenizer_files"}`` (the
    tokenizer's record, None when the checkpoint does not say which)."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise CheckpointError(f"{out_dir} exists and is not an empty directory: will not overwrite it")
    opened = open_any(directory)
    refuse_torch_dist(opened, "export --format hf")
    reader = opened.reader
    prefix = opened.model_prefix if prefix is None else prefix
    metadata = reader.read_metadata()
    selected = [c for c in _select(metadata, prefix) if c[2] is not None]
    if any(name.startswith(MEGATRON_CORE_NAMES) for _key, name, _md in selected):
        return export_megatron_gpt(opened, selected, out_dir, config)
    hf_config = _read_config(reader, metadata, None if config is None else os.fspath(config))
    if LORA_CONFIG_ENTRY in metadata.state_dict_metadata:  # a LoRA run: merged model + adapter folder
        return export_lora_hf(reader, metadata, out_dir, hf_config, prefix, TIED_OUTPUT)
    tensors = selected
    if hf_config.get("tie_word_embeddings"):
        tensors = [c for c in tensors if c[1] != TIED_OUTPUT]
    if not tensors:
        raise CheckpointError(f"{reader.path} holds no tensors under the prefix {prefix!r}")
    dtypes = {str(c[2].properties.dtype) for c in tensors}
    if len(dtypes) == 1 and next(iter(dtypes)) in _DTYPE_NAMES:
        hf_config["dtype"] = _DTYPE_NAMES[dtypes.pop()]  # what from_pretrained(dtype="auto") then builds
        hf_config.pop("torch_dtype", None)
    shards = _shards(tensors, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    with building(out_dir) as partial:
        for name, members in zip(names, shards):
            _write_safetensors(os.path.join(partial, name), reader, members, budget_bytes)
        total = sum(_nbytes(c) for c in tensors)
        if len(shards) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {c[1]: name for name, members in zip(names, shards) for c in members}}
            write_json(os.path.join(partial, "model.safetensors.index.json"), index)
        write_json(os.path.join(partial, "config.json"), hf_config)
        companions = write_companions(reader, metadata, partial, hf_config)
    return {"tensors": len(tensors), "bytes": total, "files": len(shards), **companions}
