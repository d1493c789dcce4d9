"""Pretrained Hugging Face checkpoints in and out of sharded models: small
Llamas saved with transformers' own ``save_pretrained`` (one file, and shards
with an index), built on the meta device, sharded, filled by
``flatfsdp.load_pretrained`` at 2 and 4 ranks, compared with the unsharded
model; fine-tuned, exported with ``flatfsdp checkpoint export --format hf`` and
loaded back with ``from_pretrained``. Nothing is downloaded."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flatfsdp  # noqa: E402
from flatfsdp import checkpoint  # noqa: E402
from flatfsdp.checkpoint import CheckpointError  # noqa: E402
from flatfsdp.checkpoint.cli import main as checkpoint_main  # noqa: E402
from flatfsdp.pretrained import hf_model_on_meta, hf_unit_classes  # noqa: E402
from harness import run_ranks  # noqa: E402

TOKENS = torch.arange(24).reshape(2, 12) * 7 % 300


BUDGET = 8 << 20
"""The loader's fixed memory budget (docs/pretrained.md): Python objects, headers,
pages mapped around each region's ends."""


def _config(tied: bool, **sizes):
    shape = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, max_position_embeddings=64)
    shape.update(sizes)
    return transformers.LlamaConfig(tie_word_embeddings=tied, use_cache=False, **shape)


def _save(model, path, **kwargs) -> str:
    model.save_pretrained(path, **kwargs)
    return str(path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(0)
    tied = transformers.LlamaForCausalLM(_config(tied=True))
    untied = transformers.LlamaForCausalLM(_config(tied=False))
    with torch.no_grad():  # non-trivial norms, so a norm left at ones shows
        for model in (tied, untied):
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
    out = {"tied": _save(tied, root / "tied"),  # one model.safetensors
           "tied_sharded": _save(tied, root / "tied_sharded", max_shard_size="100KB"),
           "untied_sharded": _save(untied, root / "untied_sharded", max_shard_size="100KB"),
           "untied_bf16": _save(untied.to(torch.bfloat16), root / "untied_bf16")}
    # For memory: 11.5M parameters (46 MB in fp32), the largest 4 MB; 5 files.
    big = transformers.LlamaForCausalLM(_config(tied=False, vocab_size=4096, hidden_size=256, num_hidden_layers=12,
                                                num_attention_heads=8, num_key_value_heads=4, intermediate_size=768))
    out["big"] = _save(big, root / "big", max_shard_size="10MB")
    out["with_table"] = str(root / "with_table.safetensors")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    safetensors_torch.save_file(_WithTable().state_dict(), out["with_table"])
    assert (root / "tied_sharded" / "model.safetensors.index.json").is_file()
    assert not (root / "tied" / "model.safetensors.index.json").is_file()
    return out


# ---- in one process: names, errors ----------------------------------------------------------


def test_names_may_differ_by_a_prefix_either_way(saved, tmp_path):
    reference = transformers.AutoModelForCausalLM.from_pretrained(saved["tied"])
    base = _save(reference.model, tmp_path / "base")  # layers.0...., no lm_head: tied to the embedding
    head = transformers.LlamaForCausalLM(_config(tied=True))
    report = flatfsdp.load_pretrained(head, base)
    assert report.rewrite == ("model.", "")
    torch.testing.assert_close(head(TOKENS).logits, reference(TOKENS).logits, rtol=0, atol=0)
    body = transformers.LlamaModel(_config(tied=True))
    assert flatfsdp.load_pretrained(body, saved["tied"]).rewrite == ("", "model.")


def test_missing_unexpected_and_mismatched_are_listed(saved):
    other = transformers.LlamaForCausalLM(_config(tied=False, num_hidden_layers=3, intermediate_size=96))
    with pytest.raises(CheckpointError) as info:
        flatfsdp.load_pretrained(other, saved["tied"])
    message = str(info.value)
    # layer 2's nine tensors, and lm_head (the checkpoint's is tied to the embedding: not saved)
    assert "10 missing from the checkpoint: model.layers.2.self_attn.q_proj.weight" in message
    assert "... (2 more)" in message
    assert "6 shape differs: model.layers.0.mlp.gate_proj.weight is (128, 64) there, (96, 64) here" in message
    smaller = transformers.LlamaForCausalLM(_config(tied=True, num_hidden_layers=1))
    with pytest.raises(CheckpointError, match=r"9 not in the model: model\.layers\.1\."):
        flatfsdp.load_pretrained(smaller, saved["tied"])
    report = flatfsdp.load_pretrained(smaller, saved["tied"], strict=False)
    assert len(report.unexpected) == 9 and report.tensors == 11  # embedding (tied), layer 0, norm


def test_unreadable_checkpoints_are_clear_errors(saved, tmp_path):
    model = transformers.LlamaForCausalLM(_config(tied=True))
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        flatfsdp.load_pretrained(model, tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "../elsewhere.safetensors"}}))
    with pytest.raises(CheckpointError, match="is not a file name in"):
        flatfsdp.load_pretrained(model, tmp_path)
    with torch.device("meta"):
        unsharded_meta = transformers.LlamaForCausalLM(_config(tied=True))
    with pytest.raises(CheckpointError, match="on the meta device"):
        flatfsdp.load_pretrained(unsharded_meta, saved["tied"])


# ---- 2 ranks: every strategy, both front doors, bf16; fine-tune and export ---------------------


def _sharded(path: str, strategy, front_door: str, param_dtype=None):
    model = hf_model_on_meta(path)
    policy = flatfsdp.MixedPrecisionPolicy(param_dtype=param_dtype)
    if front_door == "fsdp2":
        for layer in model.model.layers:
            flatfsdp.fully_shard(layer, mp_policy=policy)
        return flatfsdp.fully_shard(model, mp_policy=policy)
    return flatfsdp.fully_shard(model, fsdp_unit_modules=hf_unit_classes(model), zero_dp_strategy=strategy,
                                mixed_precision_policy=policy)


def _reference(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


CASES = [  # (checkpoint, strategy, front door, compute dtype)
    ("tied", 3, "megatron", None), ("tied_sharded", 2, "megatron", None), ("untied_sharded", 1, "megatron", None),
    ("untied_sharded", 3, "fsdp2", None), ("untied_bf16", 3, "megatron", None),
    ("tied_sharded", 3, "megatron", torch.bfloat16), ("untied_sharded", 2, "megatron", torch.bfloat16),
]


def _measured_load(path: str) -> dict:
    """Load ``path`` into a meta-built ZeRO-3 model; peak resident memory above
    the moment before the load, against the documented bound."""
    from flatfsdp.bench.memory import PeakMemory

    model = _sharded(path, 3, "megatron")
    params = list(model.parameters())
    shard = sum(p.to_local().numel() * p.to_local().element_size() for p in params)
    largest = max(p.numel() * p.element_size() for p in params)
    probe = PeakMemory(torch.device("cpu"))
    report = flatfsdp.load_pretrained(model, path)
    return {"peak": probe.peak_bytes(), "exact": probe.mark_reset, "shard": shard, "largest": largest,
            "report": report, "model": model}


class _WithTable(torch.nn.Module):
    """A module whose non-persistent buffer only its constructor computes, beside
    its own parameter (so meta-device sharding gives the buffer storage, uninitialised)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4, 4))
        self.register_buffer("table", torch.arange(4.0), persistent=False)


def _meta_buffer_error(path: str) -> str:
    with torch.device("meta"):
        model = _WithTable()
    flatfsdp.fully_shard(model)
    try:
        flatfsdp.load_pretrained(model, path)
    except ValueError as exc:
        return str(exc)
    return "no error"


def load_worker(rank, world, saved, ckpt_dir):
    measured = _measured_load(saved["big"])
    del measured["model"]
    out = {"memory": measured, "meta_buffer": _meta_buffer_error(saved["with_table"])}
    for name, strategy, door, dtype in CASES:
        model = _sharded(saved[name], strategy, door, dtype)
        report = flatfsdp.load_pretrained(model, saved[name])
        reference = _reference(saved[name])
        weights = max((p.full_tensor() - reference.get_parameter(n)).abs().max().item()
                      for n, p in model.named_parameters())
        with torch.no_grad():
            logits = (model(TOKENS).logits.float() - reference(TOKENS).logits).abs().max().item()
        out[(name, strategy, door, dtype)] = {"weights": weights, "logits": logits, "report": report}
    # Fine-tune the tied model a few steps, then save it as `flatfsdp train --hf-model` does.
    model = _sharded(saved["tied_sharded"], 3, "megatron")
    optimizer = flatfsdp.fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    flatfsdp.load_pretrained(model, saved["tied_sharded"])
    losses = []
    for step in range(3):
        batch = (TOKENS + 31 * (step * world + rank)) % 300
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        out["tuned_logits"] = model(TOKENS).logits
    checkpoint.save({"model": model.state_dict(), checkpoint.HF_CONFIG_ENTRY: model.config.to_json_string()},
                    ckpt_dir)
    out["losses"] = losses
    return out


@pytest.fixture(scope="module")
def two_ranks(saved, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("tuned") / "ckpt")
    results = run_ranks(load_worker, 2, saved, ckpt, timeout=600)
    return results, ckpt


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_loads_sharded_at_two_ranks_like_the_unsharded_model(two_ranks, case):
    for rank_result in two_ranks[0]:
        got = rank_result[case]
        assert got["weights"] == 0.0  # main weights: the checkpoint's values, converted exactly
        assert got["logits"] <= (0.0 if case[3] is None else 0.05), got
        assert got["report"].temporary_bytes == 0


def test_a_meta_built_buffer_no_checkpoint_holds_is_an_error(two_ranks):
    for rank_result in two_ranks[0]:
        assert rank_result["meta_buffer"].startswith("non-persistent buffers table were built on the meta device")


def test_each_rank_reads_only_its_own_rows(two_ranks, saved):
    reports = [r[("tied_sharded", 2, "megatron", None)]["report"] for r in two_ranks[0]]
    total = sum(p.numel() * 4 for p in _reference(saved["tied_sharded"]).parameters())
    assert sum(r.bytes_read for r in reports) == total  # fp32 file: every row read once, by one rank
    assert all(r.files == 4 and r.tensors == 20 for r in reports)


def test_fine_tuned_model_exports_to_hugging_face_format(two_ranks, tmp_path):
    results, ckpt = two_ranks
    assert results[0]["losses"][-1] < results[0]["losses"][0]
    out = tmp_path / "hf"
    checkpoint_main(["export", "--format", "hf", ckpt, str(out), "--max-shard-mib", "0"])
    files = sorted(p.name for p in out.iterdir())
    assert "config.json" in files and "model.safetensors.index.json" in files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied: written once, as save_pretrained does
    assert len(set(index["weight_map"].values())) == len(index["weight_map"]) == 20  # one file each
    exported = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    with torch.no_grad():
        diff = (exported(TOKENS).logits - results[0]["tuned_logits"]).abs().max().item()
    assert diff <= 1e-6, diff
    one_file = tmp_path / "one"
    checkpoint.export_hf(ckpt, one_file)
    # Saved by a script, not flatfsdp train: no tokenizer to carry, generation settings from the config.
    assert sorted(p.name for p in one_file.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    with pytest.raises(CheckpointError, match="will not overwrite"):
        checkpoint.export_hf(ckpt, one_file)


# ---- memory, and 4 ranks --------------------------------------------------------------------


def _check_memory(measured: dict) -> None:
    report = measured["report"]
    # What the loader read is exactly this rank's shard (fp32 file into fp32 main weights).
    assert report.bytes_read == measured["shard"] and report.temporary_bytes == 0
    bound = measured["shard"] + measured["largest"] + BUDGET
    if measured["exact"]:  # the kernel let us reset the high-water mark
        assert measured["peak"] <= bound, measured


def test_loading_memory_at_two_ranks_is_bounded(two_ranks):
    for rank_result in two_ranks[0]:
        _check_memory(rank_result["memory"])


def four_rank_worker(rank, world, path):
    measured = _measured_load(path)
    model = measured.pop("model")
    reference = _reference(path)
    with torch.no_grad():
        measured["logits"] = (model(TOKENS).logits - reference(TOKENS).logits).abs().max().item()
    return measured


def test_four_ranks_load_within_the_memory_bound_and_match(saved):
    for measured in run_ranks(four_rank_worker, 4, saved["big"], timeout=600):
        _check_memory(measured)
        assert measured["logits"] == 0.0
