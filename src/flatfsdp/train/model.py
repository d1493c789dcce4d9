"""The one place that turns options into a model and into `fully_shard` keywords."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

import flatfsdp
from flatfsdp.models.gpt import GPT, GPTConfig, TransformerBlock
from flatfsdp.train import hf
from flatfsdp.train.options import TrainOptions


@dataclass
class BuiltModel:
    model: nn.Module
    """The model, not yet sharded (possibly on the meta device)."""
    units: list
    """``fsdp_unit_modules``: classes or import-path strings."""
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    """(model, inputs [batch, seq], targets [batch, seq]) -> the summed token loss (fp32), whatever
    the model's calling convention; chunked over tokens, so no micro-batch's logits exist whole."""
    pretrained: str | None = None
    """A Hugging Face directory whose weights fill the model once sharded (it is built on the meta device)."""
    hf_config: str | None = None
    """A transformers model's config as JSON: saved with checkpoints, so they export to Hugging Face format."""
    lora_config: str | None = None
    """--lora-rank: the adapters' settings as JSON, saved with checkpoints (export merges or writes them)."""
    hf_generation_config: str | None = None
    """The --hf-model folder's generation_config.json, saved with checkpoints (export writes it back)."""


def _gpt_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(inputs, targets=targets, reduction="sum")


def build_model(o: TrainOptions, device: torch.device, vocab_size: int) -> BuiltModel:
    """The unsharded model. Weights depend only on ``--seed``: the GPT is
    initialised with ``flatfsdp.reset_parameters(model, seed)``, the very values
    meta-device initialisation produces, so the same seed gives the same model
    with or without ``--init-model-with-meta-device``."""
    if o.hf_model:  # a directory
        model, units = hf.build_pretrained(o, device)
        config = hf.config_json(model)
        lora_config = None
        if o.lora_rank is not None:
            from flatfsdp.train import lora
            lora_config = lora.add_adapters(model, o)
        return BuiltModel(model, units, hf.loss_fn(model), pretrained=o.hf_model, hf_config=config,
                          lora_config=lora_config, hf_generation_config=hf.generation_config_json(o.hf_model))
    if o.hf_model is not None:  # bare --hf-model
        torch.manual_seed(o.seed)
        model = hf.build_llama(o, vocab_size)
        config = hf.config_json(model)
        return BuiltModel(model.to(device), [hf.LLAMA_UNIT], hf.loss_fn(model), hf_config=config)
    config = GPTConfig(vocab_size=vocab_size, seq_len=o.seq_length, n_layer=o.num_layers,
                       n_head=o.num_attention_heads, d_model=o.hidden_size, recompute=o.recompute)
    if o.init_model_with_meta_device:
        with torch.device("meta"):
            return BuiltModel(GPT(config), [TransformerBlock], _gpt_loss)
    model = flatfsdp.reset_parameters(GPT(config), o.seed)
    return BuiltModel(model.to(device), [TransformerBlock], _gpt_loss)


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
        param_gather_dtype=o.param_gather_dtype,
        grad_reduce_dtype=o.grad_reduce_dtype,
    )


def shard(built: BuiltModel, o: TrainOptions) -> tuple[nn.Module, torch.optim.Optimizer]:
    """AdamW over the unsharded parameters, then one `fully_shard` call for both;
    a pretrained model's weights are then read into each rank's shards."""
    trainable = [p for p in built.model.parameters() if p.requires_grad]  # LoRA: the adapters alone
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=o.lr, betas=(0.9, 0.95))
    model, optimizer = flatfsdp.fully_shard(built.model, optimizer, fsdp_unit_modules=built.units, **shard_kwargs(o))
    flatfsdp.set_on_nonfinite(model, "off")  # the loop checks every step before stepping (--on-nonfinite)
    if built.pretrained:
        skip = None
        if built.lora_config is not None:
            from flatfsdp.train import lora
            lora.init_adapters(model, o.seed)  # before the load, whose mark_initialized then covers them too
            skip = lora.is_adapter
        flatfsdp.load_pretrained(model, built.pretrained, skip=skip)
    return model, optimizer
