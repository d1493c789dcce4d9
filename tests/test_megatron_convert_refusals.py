"""What `flatfsdp checkpoint convert` refuses, and what an interrupted conversion leaves.

Each bad input gets one CheckpointError naming the folder, key or option at
fault; none writes the output or touches the source. A conversion killed half
way leaves no output, and one that fails cleans up after itself. Pickled
values of the source are carried, never run.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import megatron_formats as mf
from flatfsdp import checkpoint
from flatfsdp.checkpoint import CheckpointError, convert_torch_dist_to_fsdp_dtensor as convert
from flatfsdp.checkpoint import inert_pickle
from flatfsdp.checkpoint.cli import main as checkpoint_cli
from flatfsdp.checkpoint.foreign_read import ForeignCheckpoint


def fingerprint(folder) -> dict:
    out = {}
    for base, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("refusals")
    mf.write_torch_dist(str(root / "run"))
    return root / "run"


def refused(src, out, match: str, **kwargs) -> None:
    before = fingerprint(src)
    with pytest.raises(CheckpointError, match=match):
        convert(src, out, **kwargs)
    assert fingerprint(src) == before
    assert not os.path.exists(out) or not os.listdir(out)
    assert not [n for n in os.listdir(os.path.dirname(out)) if ".partial-" in n]


def test_an_fsdp_dtensor_folder_is_named_as_such_and_needs_no_conversion(source, tmp_path):
    convert(source, tmp_path / "fd")
    refused(tmp_path / "fd", tmp_path / "again", r"fd/iter_0000007 is an fsdp_dtensor checkpoint .* not a "
                                                 r"torch_dist checkpoint: it needs no conversion")


def test_a_flatfsdp_checkpoint_is_named_as_such(tmp_path):
    checkpoint.save({"model": {"w": torch.ones(3)}}, tmp_path / "flat", no_dist=True)
    refused(tmp_path / "flat", tmp_path / "out", r"flat is a flatfsdp checkpoint .* not a torch_dist checkpoint")


def test_torch_dist_where_fsdp_dtensor_is_expected_names_the_convert_command(source, tmp_path):
    for export in (lambda: checkpoint.export_checkpoint(source, tmp_path / "x.safetensors"),
                   lambda: checkpoint.export_hf(source, tmp_path / "hf", config=tmp_path)):
        with pytest.raises(CheckpointError, match=r"iter_0000007 is a torch_dist checkpoint .* not an fsdp_dtensor "
                                                  r"checkpoint: .*flatfsdp checkpoint convert --from torch_dist"):
            export()
    assert not os.listdir(tmp_path)


def test_export_hf_of_a_converted_gated_model_is_refused_naming_its_architecture(tmp_path):
    mf.write_torch_dist(str(tmp_path / "run"), gated=True)
    convert(tmp_path / "run", tmp_path / "fd")
    with pytest.raises(CheckpointError, match=r"fd/iter_0000007: the run used --swiglu True; --format hf writes a "
                                              r"Megatron-Core GPTModel only as GPT-2"):
        checkpoint.export_hf(tmp_path / "fd", tmp_path / "hf")
    assert not [n for n in os.listdir(tmp_path) if n.startswith("hf")]


def test_a_checkpoint_of_another_model_than_its_arguments_say_is_refused(tmp_path):
    mf.write_torch_dist(str(tmp_path / "run"), run_args=mf.args(num_layers=3))
    refused(tmp_path / "run", tmp_path / "out", r"decoder\.layers\.\S+ stacks 2 layers, but the run's arguments "
                                                r"say num_layers=3")


def test_forcing_swiglu_on_a_plain_mlp_names_the_rows_that_do_not_fit(source, tmp_path):
    refused(source, tmp_path / "out", r"decoder\.layers\.mlp\.linear_fc1\.weight has 16 rows per layer; a gated "
                                      r"\(--swiglu\) MLP of ffn_hidden_size=16 has 32", swiglu=True)


def test_a_missing_optimizer_state_is_named(tmp_path):
    key = "optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc2.bias"
    mf.write_torch_dist(str(tmp_path / "run"), drop=(key,))
    refused(tmp_path / "run", tmp_path / "out", rf"missing key '{key}' \(the optimizer state of "
                                                r"decoder\.layers\.mlp\.linear_fc2\.bias\)")


def test_bucket_space_optimizer_state_is_refused_and_model_only_converts_the_weights(tmp_path):
    tensors = mf.write_torch_dist(str(tmp_path / "run"), optimizer_format="dp_reshardable")
    refused(tmp_path / "run", tmp_path / "out", r"stored as 'dp_reshardable'.*--dist-ckpt-optim-fully-reshardable.*"
                                                r"--model-only")
    report = convert(tmp_path / "run", tmp_path / "out", model_only=True)
    assert report["optimizer_states"] == []
    reader = ForeignCheckpoint(report["output"])
    assert not [k for k in reader.entries if k.startswith("optimizer.")]
    weight = reader.read_tensor("model.module.decoder.layers.1.mlp.linear_fc2.weight")
    assert torch.equal(weight, tensors["decoder.layers.mlp.linear_fc2.weight"][1])  # the model's, not the main


def test_optimizer_groups_not_built_by_the_standard_rule_are_refused(tmp_path):
    mf.write_torch_dist(str(tmp_path / "run"), run_args=mf.args(decoupled_lr=0.1))
    refused(tmp_path / "run", tmp_path / "out", r"--decoupled-lr")


def test_an_existing_output_is_never_written_over_nor_one_inside_the_source(source, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("keep")
    with pytest.raises(CheckpointError, match="taken exists and is not an empty directory"):
        convert(source, tmp_path / "taken")
    assert (tmp_path / "taken" / "mine.txt").read_text() == "keep"
    with pytest.raises(CheckpointError, match="is inside the checkpoint being converted"):
        convert(source, source / "iter_0000007" / "sub")
    assert not (source / "iter_0000007" / "sub").exists()


def test_a_conversion_that_fails_half_way_leaves_no_output(source, tmp_path, monkeypatch):
    calls = []
    real = ForeignCheckpoint.read_regions

    def failing(self, regions):
        calls.append(1)
        if len(calls) > 5:
            raise OSError(28, "No space left on device")
        return real(self, regions)

    monkeypatch.setattr(ForeignCheckpoint, "read_regions", failing)
    before = fingerprint(source)
    with pytest.raises(OSError, match="No space left"):
        convert(source, tmp_path / "out")
    assert len(calls) == 6 and not os.listdir(tmp_path) and fingerprint(source) == before


def test_a_conversion_killed_half_way_leaves_no_output_and_the_next_one_succeeds(source, tmp_path):
    killer = textwrap.dedent(f"""
        import os, signal
        from flatfsdp.checkpoint import torch_dist_convert as c
        real, count = c._StreamingSavePlanner.resolve_data, [0]
        def dying(self, item):
            count[0] += 1
            if count[0] == 10:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, item)
        c._StreamingSavePlanner.resolve_data = dying
        c.convert_torch_dist_to_fsdp_dtensor({str(source)!r}, {str(tmp_path / 'out')!r})
    """)
    before = fingerprint(source)
    result = subprocess.run([sys.executable, "-c", killer], capture_output=True, timeout=120)
    assert result.returncode == -9
    assert not (tmp_path / "out").exists() and fingerprint(source) == before
    assert [n for n in os.listdir(tmp_path) if n.startswith("out.partial-")]  # the dead writer's, under its own name
    convert(source, tmp_path / "out")
    assert checkpoint.summarize(tmp_path / "out", verify_data=True)["verified"]


class _Runs:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickled_values_of_the_source_are_carried_never_run(tmp_path):
    marker = tmp_path / "ran"
    mf.write_torch_dist(str(tmp_path / "run"), run_args=mf.args(payload=_Runs(str(marker))))
    report = convert(tmp_path / "run", tmp_path / "out")
    checkpoint.summarize(tmp_path / "out", verify_data=True)
    checkpoint.export_checkpoint(tmp_path / "out", tmp_path / "model.safetensors")
    assert not marker.exists()
    args = ForeignCheckpoint(report["output"]).read_objects(["args"])["args"]
    call = inert_pickle.fields(args)["payload"]
    assert call.global_name in ("posix.system", "os.system") and call._args == (f"touch {marker}",)
    assert not marker.exists()


def test_the_command_prints_one_line_for_a_bad_input_and_a_summary_when_it_converts(source, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        checkpoint_cli(["convert", "--from", "torch_dist", "--to", "fsdp_dtensor", str(tmp_path / "nowhere"),
                        str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"flatfsdp checkpoint convert: error: no checkpoint at {tmp_path / 'nowhere'}: the directory "
                   "does not exist"]
    checkpoint_cli(["convert", str(source), str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert out.startswith("wrote iteration 7 as fsdp_dtensor: 29 parameters, optimizer state (exp_avg, exp_avg_sq")
    assert "--load " in out and (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "7"
