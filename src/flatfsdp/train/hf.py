"""`--hf-model`: a tiny Hugging Face Llama built from a config, sharded by the
import path of its decoder-layer class (so flatfsdp never imports transformers
itself, and the same string would work in a user's script)."""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from flatfsdp.train.options import TrainOptions, UsageError

LLAMA_UNIT = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"
"""The sharding unit: one decoder layer, named by import path."""


def require_transformers() -> None:
    # find_spec answers None both when the package is absent and when a test
    # blocks it with sys.modules["transformers"] = None.
    try:
        found = importlib.util.find_spec("transformers") is not None
    except ValueError:
        found = False
    if not found:
        raise UsageError("--hf-model needs the transformers package: pip install 'flatfsdp[hf]'")


def build_llama(o: TrainOptions, vocab_size: int) -> nn.Module:
    """A randomly initialised LlamaForCausalLM of the requested size (fp32, CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=o.hidden_size, num_hidden_layers=o.num_layers,
        num_attention_heads=o.num_attention_heads, num_key_value_heads=o.num_attention_heads,
        # Llama's ~8/3 MLP ratio, rounded to a multiple of 32.
        intermediate_size=-(-o.hidden_size * 8 // 3 // 32) * 32,
        max_position_embeddings=o.seq_length, attention_dropout=0.0, use_cache=False)
    model = LlamaForCausalLM(config)
    if o.recompute != "none":
        kwargs = {"use_reentrant": o.recompute == "reentrant"}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def llama_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, use_cache=False).logits
