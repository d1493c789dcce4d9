"""`flatfsdp checkpoint inspect` and `export` read an fsdp_dtensor checkpoint whichever library wrote it.

The checkpoints are written the way Megatron-LM writes one (``--ckpt-format
fsdp_dtensor``): the state dict of the Megatron-FSDP model -- ``module.``-prefixed,
its sharded parameters DTensors whose chunks are wherever the library put them
(uneven for stock) -- under ``model``, beside ``args``, ``iteration`` and
``checkpoint_version``, saved by plain DCP from both ranks into
``iter_0000003`` with the tracker file beside it, no manifest. Once by stock
megatron-fsdp 0.6.1 and once by flatfsdp.megatron_fsdp, with the same user code,
on a tiny Hugging Face Llama after one training step. What is exported must be
the model each rank holds (gathered by hand here), and ``--format hf`` a folder
transformers loads into a model whose logits are the trained model's.
"""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

from harness import run_ranks
from flatfsdp import checkpoint
from flatfsdp.checkpoint import CheckpointError

transformers = pytest.importorskip("transformers")
pytest.importorskip("megatron_fsdp", reason="pip install --no-deps megatron-fsdp==0.6.1 (the test extra's note)")
from safetensors.torch import load_file  # noqa: E402

from test_megatron_fsdp_checkpoints import library, whole  # noqa: E402

CONFIG = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=48, max_position_embeddings=32, tie_word_embeddings=False, use_cache=False)
TOKENS = torch.arange(12).reshape(2, 6) * 7 % 96


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))


def write_one(rank, world, lib_name, root):
    lib = library(lib_name)
    net = tiny_llama()
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_shard", "tp"))
    layer = type(net.model.layers[0])
    model, optimizer = lib.fully_shard(
        module=net, optimizer=torch.optim.Adam(net.parameters(), lr=0.01), device_mesh=mesh, dp_shard_dim="dp_shard",
        tp_dim="tp", fsdp_unit_modules=[layer], zero_dp_strategy="optim_grads_params", device=torch.device("cpu"),
        mixed_precision_policy=lib.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                                        main_grads_dtype=torch.float32),
        sync_model_each_microbatch=True)
    model(input_ids=TOKENS[rank:rank + 1], labels=TOKENS[rank:rank + 1]).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    state = model.state_dict()
    trained = {k: whole(v) for k, v in state.items()}
    folder = os.path.join(root, "iter_0000003")
    dcp.save({"model": state, "args": argparse.Namespace(num_layers=2, use_megatron_fsdp=True), "iteration": 3,
              "checkpoint_version": 3.0}, checkpoint_id=folder)
    if rank == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("3")
    dist.barrier()
    return trained


def write_worker(rank, world, roots):
    return {lib: write_one(rank, world, lib, os.path.join(root, "run")) for lib, root in roots.items()}


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    roots = {lib: tmp_path_factory.mktemp(f"fsdp_dtensor_{lib}") for lib in ("stock", "flatfsdp")}
    trained = run_ranks(write_worker, 2, {lib: str(root) for lib, root in roots.items()})[0]
    return {lib: (lib, roots[lib], trained[lib]) for lib in roots}


@pytest.fixture(params=["stock", "flatfsdp"])
def written(request, both):
    return both[request.param]


def test_inspect_names_the_format_and_lists_the_model_unverified(written):
    _lib, root, trained = written
    summary = checkpoint.summarize(root / "run")
    assert summary["format"] == "fsdp_dtensor" and not summary["verified"]
    assert summary["directory"].endswith("iter_0000003")
    shapes = {t["name"]: tuple(t["shape"]) for t in summary["tensors"]}
    assert shapes == {f"model.{k}": tuple(v.shape) for k, v in trained.items()}
    assert {o["name"] for o in summary["objects"]} == {"args", "iteration", "checkpoint_version"}


def test_export_writes_the_model_each_rank_held(written):
    _lib, root, trained = written
    counts = checkpoint.export_checkpoint(root / "run", root / "model.safetensors")
    exported = load_file(root / "model.safetensors")
    assert counts["tensors"] == len(trained)
    assert exported.keys() == {k.removeprefix("module.") for k in trained}
    for key, value in trained.items():
        assert torch.equal(exported[key.removeprefix("module.")], value), key


def test_export_hf_loads_in_transformers_with_the_trained_models_logits(written):
    _lib, root, trained = written
    config = root / "config.json"
    config.write_text(json.dumps(transformers.LlamaConfig(**CONFIG).to_dict()))
    checkpoint.export_hf(root / "run", root / "hf", config=config)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(root / "hf")
    reference = tiny_llama()
    reference.load_state_dict({k.removeprefix("module."): v for k, v in trained.items()})
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, reference(TOKENS).logits)
    untrained = tiny_llama()
    with torch.no_grad():
        assert not torch.equal(loaded(TOKENS).logits, untrained(TOKENS).logits)  # the step is in it


def test_a_truncated_data_file_is_named_before_anything_is_read(written, tmp_path):
    _lib, root, _trained = written
    import shutil
    copy = tmp_path / "run"
    shutil.copytree(root / "run", copy)
    data = copy / "iter_0000003" / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp: truncated \(100 bytes; the checkpoint's \.metadata "
                                              r"reads up to byte \d+\)"):
        checkpoint.export_checkpoint(copy, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
