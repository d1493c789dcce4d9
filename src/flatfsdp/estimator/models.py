"""The models the estimator builds, by name: the package's GPT by size, Llama 3
by its public shapes, a Hugging Face config (a config.json file, a directory
holding one, or a hub name), or a user's own ``package.module:function``.

Every model is built with its parameters on the meta device: nothing of its
size is allocated here. Which modules are the sharding units comes with it.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from flatfsdp.models.gpt import GPT, GPTConfig, TransformerBlock

# GPT-2's published shapes (layers, width, heads), with its 50,257-token
# vocabulary and 1,024 positions; "gpt-tiny" is `flatfsdp train`'s default model.
GPT_SIZES = {
    "gpt-tiny": GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128),
    "gpt2-124m": GPTConfig(vocab_size=50257, seq_len=1024, n_layer=12, n_head=12, d_model=768),
    "gpt2-350m": GPTConfig(vocab_size=50257, seq_len=1024, n_layer=24, n_head=16, d_model=1024),
    "gpt2-774m": GPTConfig(vocab_size=50257, seq_len=1024, n_layer=36, n_head=20, d_model=1280),
    "gpt2-1.5b": GPTConfig(vocab_size=50257, seq_len=1024, n_layer=48, n_head=25, d_model=1600),
}

# Meta's published Llama 3 shapes (the config.json of each release).
_LLAMA3_COMMON = dict(model_type="llama", vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_theta=500000.0, num_key_value_heads=8, hidden_act="silu", tie_word_embeddings=False,
                      attention_bias=False, mlp_bias=False, bos_token_id=128000, eos_token_id=128001)
LLAMA_SIZES = {
    "llama-3-8b": dict(_LLAMA3_COMMON, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32),
    "llama-3-70b": dict(_LLAMA3_COMMON, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64),
}

BUILT_IN = sorted(GPT_SIZES) + sorted(LLAMA_SIZES)


@dataclass
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]
    """The unsharded model, parameters on the meta device (non-persistent
    buffers may be real: call it under the mode the tensors should live in)."""
    units: list
    """``fsdp_unit_modules``."""
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    """tokens [batch, seq] -> logits [batch, seq, vocab]."""
    vocab_size: int
    parallelize: Callable[[nn.Module, object], None] | None = None
    """Apply its tensor-parallel plan over a 1-D tp mesh (None: it has none)."""
    from_checkpoint: bool = False
    """Its modules have no ``reset_parameters`` (a transformers model): training
    fills the weights from a checkpoint, so the estimator declares them filled
    (``flatfsdp.mark_initialized``) instead of initialising them."""


def _gpt_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens)


def _hf_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, use_cache=False).logits


def resolve_model(name: str, *, units: list[str] | None = None, recompute: str = "none") -> ModelSpec:
    """The model ``name`` names (see the module docstring); ``units``
    overrides its sharding units (class names or import paths)."""
    if name in GPT_SIZES:
        config = GPT_SIZES[name]
        config = GPTConfig(**{**config.__dict__, "recompute": recompute})

        def build() -> nn.Module:
            with torch.device("meta"):
                return GPT(config)
        return ModelSpec(name, build, units or [TransformerBlock], _gpt_logits, config.vocab_size,
                         parallelize=_gpt_tensor_parallel)
    if name in LLAMA_SIZES:
        return _hf_spec(name, _hf_config(dict(LLAMA_SIZES[name])), units, recompute)
    if ":" in name and not os.path.exists(name):
        return _user_spec(name, units)
    if os.path.isdir(name) or name.endswith(".json"):
        path = os.path.join(name, "config.json") if os.path.isdir(name) else name
        if not os.path.isfile(path):
            raise ValueError(f"--model {name}: no config.json there")
        with open(path) as f:
            return _hf_spec(name, _hf_config(json.load(f), source=path), units, recompute)
    if "/" in name:  # a hub name: transformers fetches (or finds cached) its config.json
        from transformers import AutoConfig
        try:
            config = AutoConfig.from_pretrained(name)
        except OSError as exc:
            raise ValueError(f"--model {name}: cannot read its config from the Hugging Face hub or cache "
                             f"({' '.join(str(exc).split())[:200]})") from None
        return _hf_spec(name, config, units, recompute)
    raise ValueError(f"--model {name}: not a built-in model ({', '.join(BUILT_IN)}), a config.json, a directory "
                     "holding one, a hub name or a package.module:function")


def _gpt_tensor_parallel(model: nn.Module, tp_mesh) -> None:
    """Megatron's MLP split: the up projection by columns, the down one by rows.
    (The fused q/k/v projection stays whole: splitting its columns would mix
    the three.)"""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.blocks:
        parallelize_module(block.mlp, tp_mesh, {"fc": ColwiseParallel(), "proj": RowwiseParallel()})


_HF_COLUMNS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_HF_ROWS = ("self_attn.o_proj", "mlp.down_proj")


def _hf_tensor_parallel(model: nn.Module, tp_mesh) -> None:
    """The Llama-family plan: q, k, v, gate and up projections by columns (whole
    heads per rank), o and down projections by rows; embeddings, norms and the
    output layer stay whole."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    config = model.config
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name, None) or config.num_attention_heads
        if heads % tp:
            raise ValueError(f"tensor parallelism over {tp} ranks needs {name} ({heads}) divisible by {tp}")
    layers = [m for m in model.modules() if all(_has(m, path) for path in _HF_COLUMNS + _HF_ROWS)]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no layer with the Llama-family projections "
                         f"({', '.join(_HF_COLUMNS + _HF_ROWS)}); no tensor-parallel plan for it")
    plan = {**{path: ColwiseParallel() for path in _HF_COLUMNS}, **{path: RowwiseParallel() for path in _HF_ROWS}}
    for layer in layers:
        parallelize_module(layer, tp_mesh, plan)


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def _hf_config(values: dict, source: str = "built-in shape"):
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ValueError("Hugging Face models need the transformers package: pip install 'flatfsdp[hf]'") from None
    values = dict(values)
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"{source}: the config names no model_type")
    return AutoConfig.for_model(model_type, **values)


def _hf_spec(name: str, config, units: list[str] | None, recompute: str) -> ModelSpec:
    from flatfsdp.pretrained import hf_model_from_config, hf_unit_classes

    def build() -> nn.Module:
        model = hf_model_from_config(config)
        if recompute != "none":
            kwargs = {"use_reentrant": recompute == "reentrant"}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return model

    if units is None:
        units = hf_unit_classes(_class_probe(config))
    return ModelSpec(name, build, units, _hf_logits, config.vocab_size, parallelize=_hf_tensor_parallel,
                     from_checkpoint=True)


def _class_probe(config) -> nn.Module:
    """A one-layer model of ``config``'s architecture, on meta: only its class
    names are read (which decoder-layer class is the unit)."""
    from transformers import AutoModelForCausalLM

    small = config.__class__.from_dict({**config.to_dict(), "num_hidden_layers": 1})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(small)


def _user_spec(name: str, units: list[str] | None) -> ModelSpec:
    module_name, _, attr = name.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--model {name}: cannot import {attr!r} from {module_name!r} ({exc})") from None
    if not units:
        raise ValueError(f"--model {name}: say which modules are the sharding units (--units ClassName ...)")

    def build() -> nn.Module:
        with torch.device("meta"):
            model = factory()
        if not isinstance(model, nn.Module):
            raise ValueError(f"--model {name}: {attr}() returned {type(model).__name__}, not an nn.Module")
        return model

    vocab = getattr(getattr(factory, "config", None), "vocab_size", None) or 2
    return ModelSpec(name, build, units, _gpt_logits, vocab)
