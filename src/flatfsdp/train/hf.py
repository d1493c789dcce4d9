"""`--hf-model`: a tiny Hugging Face Llama built from a config, sharded by the
import path of its decoder-layer class (so flatfsdp never imports transformers
itself, and the same string would work in a user's script); `--hf-model DIR`:
the causal LM of a local Hugging Face directory, built on the meta device and
filled from its safetensors by each rank's own shards (flatfsdp.load_pretrained)."""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import nn

from flatfsdp.checkpoint import CheckpointError
from flatfsdp.pretrained import hf_model_on_meta, hf_unit_classes
from flatfsdp.pretrained.files import checkpoint_entries
from flatfsdp.train.data import VOCAB_SIZE
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
    return _with_recompute(LlamaForCausalLM(config), o)


def _with_recompute(model: nn.Module, o: TrainOptions) -> nn.Module:
    if o.recompute != "none":
        kwargs = {"use_reentrant": o.recompute == "reentrant"}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def build_pretrained(o: TrainOptions, device: torch.device) -> tuple[nn.Module, list]:
    """The model of directory ``--hf-model``, parameters on the meta device
    (filled after sharding), and its unit classes."""
    model = hf_model_on_meta(o.hf_model, device=device)
    return _with_recompute(model, o), hf_unit_classes(model)


def check_pretrained(path: str) -> None:
    """Before any rank starts: the directory holds a config and safetensors weights,
    and its vocabulary takes the byte tokens of the built-in data."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"--hf-model {path}: no config.json there (a local Hugging Face model directory; "
                         "nothing is downloaded)")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        checkpoint_entries(path)
    except (OSError, ValueError, CheckpointError) as exc:
        raise UsageError(f"--hf-model {path}: {' '.join(str(exc).split())}") from None
    vocab = getattr(config, "vocab_size", None)
    if vocab is None or vocab < VOCAB_SIZE:
        raise UsageError(f"--hf-model {path}: its vocabulary ({vocab} tokens) is smaller than the {VOCAB_SIZE} "
                         "byte values the built-in data feeds it as token ids")


def config_json(model: nn.Module) -> str:
    """The model's full config (defaults included), saved with checkpoints so they export to HF format."""
    return model.config.to_json_string(use_diff=False)


def llama_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, use_cache=False).logits
