"""A Megatron-Core GPTModel of GPT-2's architecture, exported as transformers' GPT2LMHeadModel.

Megatron-Core's GPT with LayerNorm, learned absolute position embeddings, a
GELU MLP with biases and multi-head attention (Megatron-LM's defaults, and the
model of ../shared/mcore-harness) computes what GPT-2 computes; only the
storage differs:

* names: ``embedding.word_embeddings`` -> ``transformer.wte``, ``decoder.layers.<i>``
  -> ``transformer.h.<i>``, ``input_layernorm`` -> ``ln_1``, ``pre_mlp_layernorm`` -> ``ln_2``
  (TransformerEngine's fused ``linear_qkv.layer_norm_*`` / ``linear_fc1.layer_norm_*`` too),
  ``linear_qkv`` -> ``attn.c_attn``, ``linear_proj`` -> ``attn.c_proj``, ``linear_fc1`` ->
  ``mlp.c_fc``, ``linear_fc2`` -> ``mlp.c_proj``, ``final_layernorm`` -> ``ln_f``,
  ``output_layer`` -> ``lm_head``;
* GPT-2's linear layers are ``Conv1D``, whose weight is the transpose of a ``Linear``'s;
* ``linear_qkv``'s output rows are grouped per head (``q_h, k_h, v_h`` for each head h),
  GPT-2's ``c_attn`` columns are all queries, then all keys, then all values.

The config comes from the run's own arguments (the checkpoint's ``args`` entry,
read inertly), or from ``--config``; either way every tensor's shape must be
what that config says, so a config of another model is refused naming the first
tensor that does not fit. Any other architecture (RMSNorm, rotary embeddings,
gated MLPs, grouped-query attention, ...) is refused naming the option.
"""

from __future__ import annotations

import re

import torch

from flatfsdp.checkpoint.errors import CheckpointError

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_LAYER_NAMES = {
    "input_layernorm.weight": "ln_1.weight", "input_layernorm.bias": "ln_1.bias",
    "self_attention.linear_qkv.layer_norm_weight": "ln_1.weight",
    "self_attention.linear_qkv.layer_norm_bias": "ln_1.bias",
    "self_attention.linear_qkv.weight": "attn.c_attn.weight", "self_attention.linear_qkv.bias": "attn.c_attn.bias",
    "self_attention.linear_proj.weight": "attn.c_proj.weight", "self_attention.linear_proj.bias": "attn.c_proj.bias",
    "pre_mlp_layernorm.weight": "ln_2.weight", "pre_mlp_layernorm.bias": "ln_2.bias",
    "mlp.linear_fc1.layer_norm_weight": "ln_2.weight", "mlp.linear_fc1.layer_norm_bias": "ln_2.bias",
    "mlp.linear_fc1.weight": "mlp.c_fc.weight", "mlp.linear_fc1.bias": "mlp.c_fc.bias",
    "mlp.linear_fc2.weight": "mlp.c_proj.weight", "mlp.linear_fc2.bias": "mlp.c_proj.bias",
}
_TOP_NAMES = {"embedding.word_embeddings.weight": "transformer.wte.weight",
              "embedding.position_embeddings.weight": "transformer.wpe.weight",
              "decoder.final_layernorm.weight": "transformer.ln_f.weight",
              "decoder.final_layernorm.bias": "transformer.ln_f.bias", "output_layer.weight": "lm_head.weight"}
_REQUIREMENTS = (("normalization", "LayerNorm", "--normalization"),
                 ("position_embedding_type", "learned_absolute", "--position-embedding-type"),
                 ("swiglu", False, "--swiglu"), ("squared_relu", False, "--squared-relu"),
                 ("group_query_attention", False, "--group-query-attention"), ("qk_layernorm", False, "--qk-layernorm"),
                 ("multi_latent_attention", False, "--multi-latent-attention"), ("num_experts", None, "--num-experts"),
                 ("apply_residual_connection_post_layernorm", False, "--apply-residual-connection-post-layernorm"))


def hf_name(name: str) -> str | None:
    """GPT-2's name for Megatron-Core's ``name``; None for one GPT-2 does not have."""
    match = _LAYER.fullmatch(name)
    if match:
        inner = _LAYER_NAMES.get(match.group(2))
        return None if inner is None else f"transformer.h.{match.group(1)}.{inner}"
    return _TOP_NAMES.get(name)


def check_architecture(args: dict, where: str) -> None:
    for option, wanted, flag in _REQUIREMENTS:
        if args.get(option, wanted) != wanted:
            raise CheckpointError(f"{where}: the run used {flag} {args[option]}; --format hf writes a Megatron-Core "
                                  "GPTModel only as GPT-2 (LayerNorm, learned positions, GELU MLP, multi-head "
                                  "attention)")


def gpt2_config(args: dict, shapes: dict[str, tuple[int, ...]]) -> dict:
    """config.json for GPT2LMHeadModel from the run's arguments and the weights' shapes."""
    layers = {int(m.group(1)) for m in map(_LAYER.fullmatch, shapes) if m}
    hidden = shapes["embedding.word_embeddings.weight"][1]
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": shapes["embedding.word_embeddings.weight"][0],
            "n_positions": shapes["embedding.position_embeddings.weight"][0], "n_embd": hidden,
            "n_layer": len(layers), "n_head": int(args["num_attention_heads"]),
            "n_inner": int(args.get("ffn_hidden_size") or 4 * hidden),
            "activation_function": "gelu_new" if args.get("openai_gelu") else "gelu",
            "layer_norm_epsilon": float(args.get("layernorm_epsilon", 1e-5)),
            "tie_word_embeddings": "output_layer.weight" not in shapes,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "use_cache": True,
            # Megatron-LM's checkpoints do not say which tokenizer the run used: no ids are claimed
            # (GPT-2's own defaults, 50256, would name a token of GPT-2's vocabulary).
            "bos_token_id": None, "eos_token_id": None}


def expected_shape(hf: str, config: dict) -> tuple[int, ...]:
    """What GPT2LMHeadModel of ``config`` holds under ``hf``."""
    d, inner = config["n_embd"], config.get("n_inner") or 4 * config["n_embd"]
    table = {"wte.weight": (config["vocab_size"], d), "wpe.weight": (config["n_positions"], d),
             "lm_head.weight": (config["vocab_size"], d), "c_attn.weight": (d, 3 * d), "c_attn.bias": (3 * d,),
             "attn.c_proj.weight": (d, d), "attn.c_proj.bias": (d,), "c_fc.weight": (d, inner), "c_fc.bias": (inner,),
             "mlp.c_proj.weight": (inner, d), "mlp.c_proj.bias": (d,)}
    return next((shape for suffix, shape in table.items() if hf.endswith("." + suffix) or hf == suffix), (d,))


def to_gpt2(hf: str, value: torch.Tensor, heads: int) -> torch.Tensor:
    """Megatron-Core's tensor in GPT-2's storage: per-head q/k/v regrouped, Conv1D weights transposed."""
    if ".attn.c_attn." in hf:
        head_dim = value.shape[0] // (3 * heads)
        grouped = value.reshape(heads, 3, head_dim, *value.shape[1:]).transpose(0, 1)
        value = grouped.reshape(value.shape)
    if hf.endswith(".weight") and (".attn.c_" in hf or ".mlp.c_" in hf):
        value = value.t()
    return value.contiguous()
