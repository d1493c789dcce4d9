"""The one place that turns options into a model and into `fully_shard` keywords."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

import flatfsdp
from flatfsdp.models.gpt import GPT, GPTConfig, TransformerBlock
from flatfsdp.train import hf
from flatfsdp.train.data import VOCAB_SIZE
from flatfsdp.train.options import TrainOptions


@dataclass
class BuiltModel:
    model: nn.Module
    """The model, not yet sharded (possibly on the meta device)."""
    units: list
    """``fsdp_unit_modules``: classes or import-path strings."""
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    """tokens [batch, seq] -> logits [batch, seq, vocab], whatever the model's calling convention."""
    pretrained: str | None = None
    """A Hugging Face directory whose weights fill the model once sharded (it is built on the meta device)."""
    hf_config: str | None = None
    """A transformers model's config as JSON: saved with checkpoints, so they export to Hugging Face format."""


def _gpt_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens)


def build_model(o: TrainOptions, device: torch.device) -> BuiltModel:
    """The unsharded model. Weights depend only on ``--seed``: the GPT is
    initialised with ``flatfsdp.reset_parameters(model, seed)``, the very values
    meta-device initialisation produces, so the same seed gives the same model
    with or without ``--init-model-with-meta-device``."""
    if o.hf_model:  # a directory
        model, units = hf.build_pretrained(o, device)
        return BuiltModel(model, units, hf.llama_logits, pretrained=o.hf_model, hf_config=hf.config_json(model))
    if o.hf_model is not None:  # bare --hf-model
        torch.manual_seed(o.seed)
        model = hf.build_llama(o, VOCAB_SIZE)
        return BuiltModel(model.to(device), [hf.LLAMA_UNIT], hf.llama_logits, hf_config=hf.config_json(model))
    config = GPTConfig(vocab_size=VOCAB_SIZE, seq_len=o.seq_length, n_layer=o.num_layers,
                       n_head=o.num_attention_heads, d_model=o.hidden_size, recompute=o.recompute)
    if o.init_model_with_meta_device:
        with torch.device("meta"):
            return BuiltModel(GPT(config), [TransformerBlock], _gpt_logits)
    model = flatfsdp.reset_parameters(GPT(config), o.seed)
    return BuiltModel(model.to(device), [TransformerBlock], _gpt_logits)


def shard_kwargs(o: TrainOptions) -> dict:
    """The `fully_shard` keywords the flags map to (docs/train.md has the table)."""
    reduce_dtype = torch.bfloat16 if o.grad_reduce_in_bf16 else torch.float32
    policy = flatfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16 if o.bf16 else None,
                                           reduce_dtype=reduce_dtype)
    return dict(
        zero_dp_strategy=o.data_parallel_sharding_strategy,
        mixed_precision_policy=policy,
        init_model_with_meta_device=o.init_model_with_meta_device,
        meta_init_seed=o.seed,
        calculate_per_token_loss=o.calculate_per_token_loss,
        # Accumulation runs under no_sync(); the last micro-batch's reductions
        # may still be in flight when backward returns and land before the
        # optimizer step, overlapping the loss bookkeeping.
        sync_model_each_microbatch=False,
    )


def shard(built: BuiltModel, o: TrainOptions) -> tuple[nn.Module, torch.optim.Optimizer]:
    """AdamW over the unsharded parameters, then one `fully_shard` call for both;
    a pretrained model's weights are then read into each rank's shards."""
    decay = [p for p in built.model.parameters() if p.dim() >= 2]
    no_decay = [p for p in built.model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=o.lr, betas=(0.9, 0.95))
    model, optimizer = flatfsdp.fully_shard(built.model, optimizer, fsdp_unit_modules=built.units, **shard_kwargs(o))
    flatfsdp.set_on_nonfinite(model, "off")  # the loop checks every step before stepping (--on-nonfinite)
    if built.pretrained:
        flatfsdp.load_pretrained(model, built.pretrained)
    return model, optimizer
