"""A Hugging Face causal LM built from its config without allocating its
weights: parameters on the meta device, for flatfsdp to shard and
``load_pretrained`` to fill.

Buffers that checkpoints do not hold (non-persistent: rotary frequency tables)
are computed for real -- they are small, and no load could fill them. The
model's own ``_init_weights`` recomputes them: it is what transformers itself
relies on after building a model on the meta device for ``from_pretrained``.
transformers is imported here only, when called.
"""

from __future__ import annotations

import os

import torch
from torch import nn


def _config(path: str):
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path}: no config.json (a Hugging Face model directory holds one)")
    return AutoConfig.from_pretrained(path, local_files_only=True)


def hf_model_on_meta(path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """``AutoModelForCausalLM`` for ``path``'s config.json, parameters on the meta
    device in ``dtype`` (the main-weight dtype; fp32 by default whatever the
    checkpoint holds), non-persistent buffers computed on ``device``."""
    return hf_model_from_config(_config(os.fspath(path)), device=device, dtype=dtype)


def hf_model_from_config(config, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """``hf_model_on_meta`` for a transformers config object."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for module in model.modules():
            meta = [name for name, buf in module._buffers.items()
                    if buf is not None and buf.is_meta and name in module._non_persistent_buffers_set]
            if meta:
                for name in meta:
                    module._buffers[name] = torch.empty_like(module._buffers[name], device=device)
                model._init_weights(module)
    return model


def hf_unit_classes(model: nn.Module) -> list[type]:
    """The classes transformers keeps whole across devices (``_no_split_modules``:
    the decoder layers) -- the natural flatfsdp units."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(f"{type(model).__name__} names no decoder-layer class (_no_split_modules); "
                         "pass fsdp_unit_modules yourself")
    return sorted(classes, key=lambda c: c.__name__)
