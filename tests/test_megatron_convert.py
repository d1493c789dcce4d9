"""`flatfsdp checkpoint convert --from torch_dist --to fsdp_dtensor`, on a small torch_dist
checkpoint laid out as Megatron-LM writes one (tests/megatron_formats.py).

What is checked is what Megatron-LM's fsdp_dtensor load asks for: the output's
entries are loaded with plain DCP into the nested state dict that load builds
(a key missing or misnamed fails the load), and every value is compared with
the box of the source it must come from -- computed here by slicing, not by
the converter's code. That a converted checkpoint resumes a real Megatron-LM
run with its losses is measured with Megatron-LM itself (docs/checkpoints.md),
which the test suite does not install.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import megatron_formats as mf
from flatfsdp.checkpoint import convert_torch_dist_to_fsdp_dtensor, summarize
from flatfsdp.checkpoint import inert_pickle
from flatfsdp.checkpoint.safe_read import SafeLoadPlanner

LOCAL_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
               "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
               "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
               "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}


def expected_params(source: dict, gated: bool) -> dict[str, tuple[str, torch.Tensor]]:
    """{fsdp_dtensor parameter name: (whole parameter name, value)}, from the source's main weights."""
    out = {}
    for key, value in source.items():
        if key.startswith("optimizer.") or not key.startswith("decoder.layers."):
            if not key.startswith("optimizer."):
                out[key] = (key, source[f"optimizer.state.param.{key}"])
            continue
        rest = key[len("decoder.layers."):]
        for layer in range(value.shape[0]):
            name = f"decoder.layers.{layer}.{LOCAL_NAMES.get(rest, rest)}"
            main = source[f"optimizer.state.param.{key}"][layer]
            if gated and rest in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
                w, v = main.chunk(2, dim=0)
                out[name.replace(rest.split(".")[-1], rest.split(".")[-1] + "_w")] = (name, w)
                out[name.replace(rest.split(".")[-1], rest.split(".")[-1] + "_v")] = (name, v)
            else:
                out[name] = (name, main)
    return out


def moment(source: dict, name: str, state: str, gated: bool) -> torch.Tensor:
    """The optimizer state of fsdp_dtensor parameter ``name``, sliced out of the source by hand."""
    parts = name.split(".")
    if parts[0] != "decoder" or parts[1] != "layers":
        return source[f"optimizer.state.{state}.{name}"]
    layer, rest = int(parts[2]), ".".join(parts[3:])
    back = {v: k for k, v in LOCAL_NAMES.items()}
    half = None
    if gated and rest.endswith(("_w", "_v")):
        rest, half = rest[:-2], rest[-1]
    value = source[f"optimizer.state.{state}.decoder.layers.{back.get(rest, rest)}"][layer]
    return value if half is None else value.chunk(2, dim=0)[0 if half == "w" else 1]


def megatron_load_template(params: dict, optimizer_prefix: str) -> dict:
    """The nested state dict Megatron-LM's fsdp_dtensor load fills (generate_state_dict's shape)."""
    wholes = sorted({whole for whole, _ in params.values()})
    return {
        "iteration": None, "checkpoint_version": None, "num_floating_point_operations_so_far": None,
        "model": {f"module.{n}": torch.empty(v.shape) for n, (_, v) in params.items()},
        "optimizer": {
            "state": {f"{optimizer_prefix}{n}": {"exp_avg": torch.empty(v.shape), "exp_avg_sq": torch.empty(v.shape),
                                                 "step": torch.empty(())} for n, (_, v) in params.items()},
            "param_to_group_meta": {f"{optimizer_prefix}{w}": {"wd_mult": None, "lr": None, "betas": None}
                                    for w in wholes}},
        "opt_param_scheduler": {"max_lr": None, "num_steps": None, "lr_decay_style": None},
        "rng_state": {"(0, 0)": [{"torch_rng_state": torch.empty(torch.get_rng_state().shape, dtype=torch.uint8),
                                  "cuda_rng_state": torch.empty(16, dtype=torch.uint8),
                                  "rng_tracker_states": {"model-parallel-rng": torch.empty(8, dtype=torch.uint8)}}]},
    }


def load_like_megatron(folder: str, template: dict) -> dict:
    """DCP's load as Megatron-LM calls it (every requested key must exist), values read weights_only."""
    dcp.load(template, storage_reader=FileSystemReader(folder), planner=SafeLoadPlanner(), no_dist=True)
    return template


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "swiglu"])
def converted(request, tmp_path_factory):
    gated = request.param
    root = tmp_path_factory.mktemp("td")
    source = mf.write_torch_dist(str(root / "run"), gated=gated)
    report = convert_torch_dist_to_fsdp_dtensor(root / "run", root / "out")
    return gated, source, report, root


def test_every_entry_loads_where_megatron_asks_for_it_with_the_source_values(converted):
    gated, source, report, root = converted
    params = expected_params(source, gated)
    state = load_like_megatron(report["output"], megatron_load_template(params, "module.module."))
    assert state["iteration"] == mf.ITERATION and state["checkpoint_version"] == 3.0
    assert state["num_floating_point_operations_so_far"] == 12345
    assert state["opt_param_scheduler"]["num_steps"] == 56
    for name, (whole, value) in params.items():
        assert torch.equal(state["model"][f"module.{name}"], value), name
        entry = state["optimizer"]["state"][f"module.module.{name}"]
        for which in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[which], moment(source, name, which, gated)), (name, which)
        assert entry["step"].item() == mf.STEP and entry["step"].dtype == torch.float32
        one_dimensional = value.dim() == 1
        meta = state["optimizer"]["param_to_group_meta"][f"module.module.{whole}"]
        assert meta["wd_mult"] == (0.0 if one_dimensional else 1.0), name  # Megatron-Core's no-decay rule
        assert meta["betas"] == (0.9, 0.999)
    rng = state["rng_state"]["(0, 0)"][0]
    assert torch.equal(rng["cuda_rng_state"], torch.arange(16, dtype=torch.uint8))
    assert report["parameters"] == len(params) and report["gated"] == gated


def test_the_output_holds_nothing_else_and_no_optimizer_state_of_its_own(converted):
    gated, source, report, _root = converted
    names = set(FileSystemReader(report["output"]).read_metadata().state_dict_metadata)
    params = expected_params(source, gated)
    tensors = {n for n in names if n.startswith(("model.", "optimizer.state."))}
    assert tensors == ({f"model.module.{n}" for n in params}
                       | {f"optimizer.state.module.module.{n}.{s}" for n in params for s in ("exp_avg", "exp_avg_sq",
                                                                                              "step")})
    assert not [n for n in names if "_extra_state" in n or n.startswith("common_state")]


def test_the_runs_arguments_are_carried_as_the_same_objects_without_importing_them(converted):
    _gated, _source, report, _root = converted
    raw = _raw_entry(report["output"], "args")
    carried = inert_pickle.loads(raw, "args")  # the enum's module is not importable here
    assert isinstance(carried, inert_pickle.Opaque) and carried.global_name == "argparse.Namespace"
    assert inert_pickle.fields(carried)["attention_backend"].global_name == f"{mf.STAND_IN}.AttnBackend"
    with mf.stand_in_module():  # where Megatron-LM loads it, its classes import: the very objects come back
        loaded = torch.load(io.BytesIO(raw), weights_only=False)
    assert vars(loaded) == vars(mf.args(_gated))


def _raw_entry(folder: str, key: str) -> bytes:
    metadata = FileSystemReader(folder).read_metadata()
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data[index]
    with open(os.path.join(folder, info.relative_path), "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def test_the_output_is_a_megatron_save_folder_that_inspect_verifies(converted):
    _gated, _source, report, root = converted
    with open(root / "out" / "latest_checkpointed_iteration.txt") as f:
        assert f.read() == str(mf.ITERATION)
    summary = summarize(root / "out", verify_data=True)
    assert summary["format"] == "fsdp_dtensor" and summary["verified"]
    assert os.path.basename(report["output"]) == f"iter_{mf.ITERATION:07d}"
