"""`flatfsdp checkpoint export --format hf` of a Megatron-Core GPTModel (Megatron-LM's fsdp_dtensor):
transformers' GPT2LMHeadModel.

The checkpoint is made from a transformers GPT-2 by the storage rules
Megatron-Core keeps (names, ``Linear`` weights, ``linear_qkv`` rows grouped per
head -- written out here independently of the exporter), laid out as
Megatron-LM's fsdp_dtensor save lays it out; the export must give back a model
with that GPT-2's logits, exactly. That the rules are Megatron-Core's was
measured against Megatron-Core's own GPTModel forward (docs/checkpoints.md).
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from flatfsdp import checkpoint
from flatfsdp.checkpoint import CheckpointError

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=40, n_positions=12, n_embd=16, n_layer=2, n_head=4, n_inner=24, activation_function="gelu",
              layer_norm_epsilon=1e-5, tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
TOKENS = (torch.arange(20).reshape(2, 10) * 7) % 40
LAYER = {"ln_1": "input_layernorm", "ln_2": "pre_mlp_layernorm", "attn.c_attn": "self_attention.linear_qkv",
         "attn.c_proj": "self_attention.linear_proj", "mlp.c_fc": "mlp.linear_fc1", "mlp.c_proj": "mlp.linear_fc2"}


def megatron_state(gpt2) -> dict:
    """GPT-2's weights as Megatron-Core's GPTModel (local spec) stores them."""
    heads, out = CONFIG["n_head"], {}
    for name, value in gpt2.state_dict().items():
        if name.endswith(".attn.bias") or name.endswith(".attn.masked_bias"):
            continue
        parts = name.split(".")
        if parts[1] == "h":
            module, leaf = ".".join(parts[3:-1]), parts[-1]
            if module.startswith(("attn.", "mlp.")) and leaf == "weight":
                value = value.t()  # Conv1D stores (in, out); Linear (out, in)
            if module == "attn.c_attn":  # [Q; K; V] -> per head [q_h; k_h; v_h]
                value = value.reshape(3, heads, -1, *value.shape[1:]).transpose(0, 1).reshape(value.shape)
            out[f"decoder.layers.{parts[2]}.{LAYER[module]}.{leaf}"] = value.contiguous()
        else:
            out[{"transformer.wte.weight": "embedding.word_embeddings.weight",
                 "transformer.wpe.weight": "embedding.position_embeddings.weight",
                 "transformer.ln_f.weight": "decoder.final_layernorm.weight",
                 "transformer.ln_f.bias": "decoder.final_layernorm.bias",
                 "lm_head.weight": "output_layer.weight"}[name]] = value.clone()
    return out


def run_args(**changes) -> argparse.Namespace:
    return argparse.Namespace(**{**dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24,
                                        normalization="LayerNorm", position_embedding_type="learned_absolute",
                                        swiglu=False, group_query_attention=False, layernorm_epsilon=1e-5),
                                 **changes})


def write_fsdp_dtensor(root, weights: dict, args) -> None:
    state = {"model": {f"module.{k}": v for k, v in weights.items()}, "args": args, "iteration": 4,
             "checkpoint_version": 3.0}
    dcp.save(state, checkpoint_id=os.path.join(root, "iter_0000004"), no_dist=True)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("4")


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG)).eval()


def test_a_megatron_gpt_exports_as_gpt2_with_the_same_logits(gpt2, tmp_path):
    write_fsdp_dtensor(tmp_path / "run", megatron_state(gpt2), run_args())
    counts = checkpoint.export_hf(tmp_path / "run", tmp_path / "hf")
    assert counts["architecture"] == "GPT2LMHeadModel" and counts["tensors"] == 4 + 12 * 2 + 1
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(loaded).__name__ == "GPT2LMHeadModel" and loaded.config.n_inner == 24
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, gpt2(TOKENS).logits)


def test_another_architecture_is_refused_naming_the_option(gpt2, tmp_path):
    write_fsdp_dtensor(tmp_path / "run", megatron_state(gpt2), run_args(normalization="RMSNorm"))
    with pytest.raises(CheckpointError, match=r"the run used --normalization RMSNorm; --format hf writes a "
                                              r"Megatron-Core GPTModel only as GPT-2"):
        checkpoint.export_hf(tmp_path / "run", tmp_path / "hf")
    assert not os.path.exists(tmp_path / "hf")


def test_a_config_of_another_model_is_refused_naming_the_tensor(gpt2, tmp_path):
    write_fsdp_dtensor(tmp_path / "run", megatron_state(gpt2), run_args())
    (tmp_path / "config.json").write_text(transformers.GPT2Config(**{**CONFIG, "n_inner": 32}).to_json_string())
    with pytest.raises(CheckpointError, match=r"model\.module\.decoder\.layers\.0\.mlp\.linear_fc1\.bias is \(24,\), "
                                              r"but the config describes another model"):
        checkpoint.export_hf(tmp_path / "run", tmp_path / "hf", config=tmp_path / "config.json")
    assert not [n for n in os.listdir(tmp_path) if n.startswith("hf")]
