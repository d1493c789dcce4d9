"""tools/gpu_check.sh's pieces, cheaply (its whole CPU dry run takes over a
minute, so it is proven by hand, docs/gpu.md): the GPU preset's size and FLOPs
to the unit, its flags, the device-check runner's outcomes, and the report
from a finished bench and from one cut off by its time limit."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from flatfsdp.bench.flops import flops_per_token, step_flops
from flatfsdp.bench.options import parse
from flatfsdp.bench.report import summarise
from flatfsdp.bench.run_records import RunRecords
from flatfsdp.bench.theory import min_state_bytes
from flatfsdp.bench.workload import build_model, llama_config
from flatfsdp.models.llama import llama_param_count

ROOT = Path(__file__).resolve().parent.parent
LLAMA_3_2_1B = 1_235_814_400


def _config(*argv: str):
    return parse(list(argv))[0]


def _report_module():
    spec = importlib.util.spec_from_file_location("gpu_check_report", ROOT / "tools" / "gpu_check" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_preset_is_llama_3_2_1b_at_4_x_4096_in_bf16_on_one_rank():
    cfg = _config("--preset", "gpu")
    assert (cfg.model, cfg.layers, cfg.d_model, cfg.heads, cfg.vocab) == ("llama", 16, 2048, 32, 128256)
    assert (cfg.batch, cfg.seq_len, cfg.bf16, cfg.nprocs, cfg.contenders) == (
        4, 4096, True, 1, ("floor", "fsdp2", "flatfsdp"))
    assert cfg.lr == 1e-4  # at 1e-3 this model's loss rises and bf16 rounding parts the contenders (gpu_preset.py)
    with torch.device("meta"):
        built = sum(p.numel() for p in build_model(cfg).parameters())
    assert built == llama_param_count(llama_config(cfg)) == LLAMA_3_2_1B
    # 6 N per token for the matmuls, 12 L d s for attention (bench/flops.py).
    assert flops_per_token(LLAMA_3_2_1B, 16, 2048, 4096) == 7_414_886_400 + 1_610_612_736
    assert step_flops(LLAMA_3_2_1B, 16, 2048, 4096, 4 * 4096) == 9_025_499_136 * 16_384
    # One rank keeps 18 bytes a parameter (bf16 copy, fp32 main, grads, AdamW): 22.2 GB of an 80 GB GPU.
    assert min_state_bytes(3, LLAMA_3_2_1B, 1, bf16=True) == 18 * LLAMA_3_2_1B == 22_244_659_200


def test_flags_given_with_the_gpu_preset_win_over_it():
    cfg = _config("--preset", "gpu", "--num-layers", "2", "--hidden-size", "64", "--steps", "1",
                  "--micro-batch-size", "1")
    assert (cfg.layers, cfg.d_model, cfg.steps, cfg.batch) == (2, 64, 1, 1)
    assert (cfg.model, cfg.heads, cfg.seq_len, cfg.bf16) == ("llama", 32, 4096, True)  # the rest still the preset's
    assert _config("--preset", "large-batch").model == "gpt"  # other presets choose only the batch shape


def test_device_check_runner_reports_each_outcome(tmp_path):
    import run_device_checks

    out = tmp_path / "checks.json"
    run_device_checks.run_all("cpu", out, timeout_s=60, only=["meta_init"])
    run_device_checks.run_all("cpu", tmp_path / "cut.json", timeout_s=0.05, only=["dcp_across_devices"])
    passed = json.loads(out.read_text())["checks"][0]
    assert passed["outcome"] == "passed" and passed["figures"]["max_diff"] == 0.0, passed
    assert json.loads((tmp_path / "cut.json").read_text())["checks"][0]["outcome"] == "timeout"


def _run(name: str, step: float, peak_mb: float, loss: float) -> dict:
    return dict(contender=name, n_params=LLAMA_3_2_1B, world=1, stage=None if name == "floor" else 3, device="cuda:0",
                memory_method="accelerator max_memory_allocated - allocated before model", torch_bytes={},
                engine_bytes=None, link=None, exposed=None, step_times=[step, step], losses=[loss + 1, loss],
                peak_bytes=[int(peak_mb * 2**20)], round=0)


def _out_dir(tmp_path: Path, bench_args: list[str], finished: bool) -> Path:
    (tmp_path / "environment.json").write_text(json.dumps(dict(
        mode="cuda", device="NVIDIA H100 80GB HBM3", capability="sm_90", memory_gib=79.1, devices=1,
        torch="2.11.0+cu130", cuda="13.0", cudnn=91000, nccl="2.27.7", driver="580.1", python="3.12.3", cpus=16,
        packages={"pytest": None, "torchao": "0.18.0"}, commit=None, date="2026-11-26T10:00:00+00:00")))
    (tmp_path / "phases.txt").write_text("environment 0 4.2\nchecks 0 61.0\n"
                                         + ("bench 0 200.5\n" if finished else "bench 124 380.0\n"))
    checks = [dict(name="parity_one_call", outcome="passed", seconds=5.0, figures={"zero3.loss_rel_diff": 1e-4}),
              dict(name="float8_all_gather", outcome="skipped", seconds=0.1, message="torchao does not import"),
              dict(name="side_streams", outcome="failed", seconds=9.0, message="Traceback\nAssertionError: boom")]
    (tmp_path / "device_checks.json").write_text(json.dumps(dict(device="cuda", checks=checks)))
    cfg = _config(*bench_args)
    runs = [_run("floor", 0.5, 40_000, 9.0), _run("fsdp2", 0.6, 30_000, 9.0), _run("flatfsdp", 0.55, 31_000, 9.0)]
    if finished:
        (tmp_path / "bench").mkdir()
        (tmp_path / "bench" / "results.json").write_text(json.dumps(dict(
            config=cfg.as_dict(), environment={}, summary=summarise(cfg, runs, {}), runs=runs), default=str))
    else:  # cut off: the runs that finished left their records, one line each (bench/run_records.py)
        records = RunRecords(tmp_path / "bench")
        for run in runs[:2]:
            records.ran(run)
        records.failed("flatfsdp", 0, "CUDA error: out of memory")
        with records.path.open("a") as f:
            f.write('{"contender": "fsdp2", "ro')  # a line cut off mid-write by the time limit
    (tmp_path / "bench.log").write_text("[bench] flatfsdp failed in round 1:\nTraceback")
    return tmp_path


@pytest.mark.parametrize("finished", [True, False])
def test_report_has_the_device_versions_and_every_figure(tmp_path, finished):
    report = _report_module()
    bench_args = ["--preset", "gpu"]
    out = _out_dir(tmp_path, bench_args, finished)
    status = report.main([str(out), "--bench-args", "--preset gpu"])
    text = (out / "report.md").read_text()
    data = json.loads((out / "report.json").read_text())
    assert status == 1  # a check failed
    for fact in ("NVIDIA H100 80GB HBM3", "2.11.0+cu130", "CUDA 13.0", "NCCL 2.27.7", "missing: pytest",
                 "1 passed, 1 failed, 1 skipped", "AssertionError: boom", "1235.8M-parameter Llama"):
        assert fact in text, fact
    rows = {r["contender"]: r for r in data["bench"]["rows"]}
    tokens, flops = 4 * 4096, 9_025_499_136 * 4 * 4096
    if finished:
        assert set(rows) == {"floor", "fsdp2", "flatfsdp"} and "bench/results.json" in text
        assert rows["flatfsdp"]["share_over_floor"] == pytest.approx(1 - 0.5 / 0.55)
    else:  # cut off: what the log shows, said so
        assert set(rows) == {"floor", "fsdp2"} and "TIMED OUT" in text and "did not finish" in text
        assert data["bench"]["notes"] == {"flatfsdp": "failed in round 1: CUDA error: out of memory"}
        assert "bench/runs.jsonl" in text and rows["fsdp2"]["runs"] == 1
        assert rows["fsdp2"]["share_over_floor"] == pytest.approx(1 - 0.5 / 0.6)
    assert rows["fsdp2"]["tokens_per_s"] == pytest.approx(tokens / 0.6)
    assert rows["fsdp2"]["tflops_per_rank"] == pytest.approx(flops / 0.6 / 1e12)
    assert rows["fsdp2"]["peak_gb"] == pytest.approx(30_000 / 1024)


@pytest.mark.parametrize("changed, tree", [(0, "| tree | abc1234 |"),
                                           (2, "| tree | abc1234 with uncommitted changes to 2 tracked file(s) |")])
def test_report_says_when_the_tree_that_ran_differs_from_its_commit(tmp_path, changed, tree):
    """The first GPU report read "tree 88e1c56" for a run made with fixes not yet committed."""
    out = _out_dir(tmp_path, ["--preset", "gpu"], True)
    env = json.loads((out / "environment.json").read_text())
    (out / "environment.json").write_text(json.dumps({**env, "commit": "abc1234", "changed_files": changed}))
    _report_module().main([str(out), "--bench-args", "--preset gpu"])
    assert tree in (out / "report.md").read_text()
