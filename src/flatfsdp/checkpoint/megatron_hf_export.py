"""``export --format hf`` of a Megatron-Core GPTModel checkpoint (Megatron-LM's fsdp_dtensor):
transformers' GPT-2 (megatron_gpt_hf.py says what maps to what).

Tensors are loaded one at a time, regrouped or transposed, and streamed into
``model.safetensors``; config.json comes from the run's own arguments (or the
caller's ``config``) and every tensor's shape is checked against it before a
byte is written. The folder appears complete or not at all, as export_hf's.
"""

from __future__ import annotations

import os

from flatfsdp.checkpoint import megatron_gpt_hf as gpt
from flatfsdp.checkpoint.errors import CheckpointError
from flatfsdp.checkpoint.export import _load_batch
from flatfsdp.checkpoint.export_folder import building, read_config_json
from flatfsdp.checkpoint.foreign_read import read_objects
from flatfsdp.checkpoint.hf_companions import write_companions, write_json
from flatfsdp.checkpoint.inert_pickle import fields
from flatfsdp.checkpoint.safetensors_format import SafetensorsStreamWriter

_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def _run_args(opened) -> dict:
    if "args" not in opened.reader.read_metadata().state_dict_metadata:
        return {}
    return fields(read_objects(opened.reader, opened.directory, ["args"])["args"])


def _config(opened, config, shapes: dict) -> dict:
    args = _run_args(opened)
    gpt.check_architecture(args, opened.directory)
    if config is None:
        if "num_attention_heads" not in args:
            raise CheckpointError(f"{opened.directory} holds no run arguments saying the number of attention heads: "
                                  "pass GPT-2's config.json (--config)")
        return gpt.gpt2_config(args, shapes)
    return read_config_json(config)


def _plan(opened, tensors, config: dict) -> list[tuple]:
    """(checkpoint key, GPT-2 name, tensor metadata, GPT-2 shape), every shape checked against ``config``."""
    plan, layers = [], set()
    for key, name, md in tensors:
        hf = gpt.hf_name(name)
        if hf is None:
            raise CheckpointError(f"{opened.directory}: {key} has no counterpart in GPT-2")
        shape = tuple(md.size)[::-1] if hf.endswith(".weight") and (".attn.c_" in hf or ".mlp.c_" in hf) \
            else tuple(md.size)
        if shape != gpt.expected_shape(hf, config):
            raise CheckpointError(f"{opened.directory}: {key} is {tuple(md.size)}, but the config describes another "
                                  f"model ({hf} {gpt.expected_shape(hf, config)} there)")
        layers.update(int(p) for p in hf.split(".")[2:3] if hf.startswith("transformer.h."))
        plan.append((key, hf, md, shape))
    if len(layers) != config.get("n_layer"):
        raise CheckpointError(f"{opened.directory} holds {len(layers)} layers, the config says {config.get('n_layer')}")
    return plan


def export_megatron_gpt(opened, tensors, out_dir: str, config=None) -> dict:
    """Write the GPTModel under ``tensors`` (export's (key, name, metadata) triples) as GPT-2 in ``out_dir``."""
    shapes = {name: tuple(md.size) for _key, name, md in tensors}
    hf_config = _config(opened, None if config is None else os.fspath(config), shapes)
    plan = _plan(opened, tensors, hf_config)
    dtypes = {str(md.properties.dtype) for _k, _h, md, _s in plan}
    if len(dtypes) == 1 and next(iter(dtypes)) in _DTYPES:
        hf_config["torch_dtype"] = _DTYPES[dtypes.pop()]
    with building(out_dir) as partial:
        with open(os.path.join(partial, "model.safetensors"), "wb") as f:
            writer = SafetensorsStreamWriter(f, [(hf, md.properties.dtype, shape) for _k, hf, md, shape in plan])
            for key, hf, md, _shape in plan:
                value = _load_batch(opened.reader, [(key, hf, md)])[key]
                writer.write(hf, gpt.to_gpt2(hf, value, int(hf_config["n_head"])))
            writer.close()
            f.flush()
            os.fsync(f.fileno())
        write_json(os.path.join(partial, "config.json"), hf_config)
        companions = write_companions(opened.reader, opened.reader.read_metadata(), partial, hf_config)
    total = sum(md.size.numel() * md.properties.dtype.itemsize for _k, _h, md, _s in plan)
    return {"tensors": len(plan), "bytes": total, "files": 1, "architecture": "GPT2LMHeadModel", **companions}
