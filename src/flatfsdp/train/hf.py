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


def require_peft() -> None:
    try:
        found = importlib.util.find_spec("peft") is not None
    except ValueError:
        found = False
    if not found:
        raise UsageError("--lora-rank needs the peft package: pip install 'flatfsdp[lora]'")


def require_model_folder(path: str) -> None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"--hf-model {path}: no config.json there (a local Hugging Face model directory; "
                         "nothing is downloaded)")


def check_pretrained(path: str, vocab_needed: int, seq_length: int, what: str) -> None:
    """Before any rank starts: the directory holds a config and safetensors weights,
    its embedding has a row for every id ``what`` (the tokenizer) can produce,
    and its positions cover ``seq_length``."""
    from transformers import AutoConfig

    require_model_folder(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        checkpoint_entries(path)
    except (OSError, ValueError, CheckpointError) as exc:
        raise UsageError(f"--hf-model {path}: {' '.join(str(exc).split())}") from None
    vocab = getattr(config, "vocab_size", None)
    if vocab is None or vocab < vocab_needed:
        raise UsageError(f"--hf-model {path}: its embedding has {vocab} rows, fewer than the {vocab_needed} token "
                         f"ids of {what}")
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and seq_length > positions:
        raise UsageError(f"--seq-length {seq_length} is past --hf-model {path}'s {positions} positions "
                         "(max_position_embeddings)")


def config_json(model: nn.Module) -> str:
    """The model's full config (defaults included), saved with checkpoints so they export to HF format."""
    return model.config.to_json_string(use_diff=False)


def generation_config_json(path: str) -> str | None:
    """``path``'s generation_config.json as it is, if it has one."""
    try:
        with open(os.path.join(path, "generation_config.json")) as f:
            return f.read()
    except FileNotFoundError:
        return None


def loss_fn(model: nn.Module):
    """The summed token loss of a transformers causal LM: chunked (models/hf_chunked.py)
    unless the model transforms its logits, then from the model's own logits."""
    from flatfsdp.models.gpt import lm_loss
    from flatfsdp.models.hf_chunked import chunking_refused, use_chunked_loss

    if chunking_refused(model):
        return lambda m, inputs, targets: lm_loss(m(input_ids=inputs, use_cache=False).logits, targets, "sum")
    use_chunked_loss(model)
    return _chunked_hf_loss


def _chunked_hf_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(input_ids=inputs, labels=targets, use_cache=False).loss
