"""The benchmark command end to end on a tiny GPT (2 ranks, gloo), and the launcher.

Times are never asserted (DESIGN.md: performance is measured, not tested);
what is deterministic is: the record has its fields, every data-parallel
contender ends on the same loss, and flatfsdp's bytes per step equal what its
schedule implies for this model's parameter counts.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
import torch.distributed as dist

from flatfsdp.bench.__main__ import main as bench_main
from flatfsdp.bench.options import parse
from flatfsdp.bench.report import summarise
from flatfsdp.bench.run_records import read_runs
from flatfsdp.launch import RankFailed, launch
from flatfsdp.models.gpt import GPT, GPTConfig

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--vocab-size", "256",
        "--max-position-embeddings", "32", "--seq-length", "32", "--micro-batch-size", "2", "--steps", "2", "--warmup",
        "2", "--repeats", "1", "--nproc-per-node", "2"]
ROW_FIELDS = {"step_s", "step_s_range", "tokens_per_s", "peak_mb", "peak_mb_range", "time_vs_fsdp2", "time_vs_floor",
              "mem_vs_fsdp2", "mem_vs_floor", "state_mb_theory", "first_loss", "last_loss", "loss_ok", "comm"}


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    bench_main(TINY + ["--contenders", "floor,fsdp2,flatfsdp", "--out", str(out), "--predict"])
    return out


@pytest.fixture(scope="module")
def results(bench_out):
    return json.loads((bench_out / "results.json").read_text())


def test_each_run_left_its_record_as_it_ended(bench_out, results):
    """runs.jsonl: one line per run, what results.json's runs hold, and the
    bench's own summary of them is results.json's (what tools/gpu_check reads
    of a bench stopped before the end)."""
    runs, notes = read_runs(bench_out / "runs.jsonl")
    assert [r["contender"] for r in runs] == ["floor", "fsdp2", "flatfsdp"] and notes == {}
    assert runs == json.loads(json.dumps(results["runs"]))
    cfg, _ = parse(TINY + ["--contenders", "floor,fsdp2,flatfsdp"])
    again = json.loads(json.dumps(summarise(cfg, runs, notes), default=str))
    assert again["rows"]["flatfsdp"]["step_s"] == results["summary"]["rows"]["flatfsdp"]["step_s"]
    assert again["rows"]["fsdp2"]["share_over_floor"] == results["summary"]["rows"]["fsdp2"]["share_over_floor"]


def test_predictions_stand_beside_the_runs_they_predict(results):
    """--predict: the floor's and flatfsdp's steps predicted from the engine's
    schedule and a probe of this machine made in the same session; not FSDP2's."""
    rows, probe = results["summary"]["rows"], results["summary"]["probe"]
    assert set(probe["cpu_s_per_byte"]) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert probe["ranks"] == 2 and probe["loopback_gbytes_s"] > 0 and probe["alone"]["by_key"]
    assert "predicted" not in rows["fsdp2"]
    for name in ("floor", "flatfsdp"):
        predicted = rows[name]["predicted"]
        assert predicted["step_s"] >= predicted["compute_s"] > 0
        assert rows[name]["prediction_error"] == pytest.approx(predicted["step_s"] / rows[name]["step_s"] - 1)
        # The traced matmuls of a step are the model's FLOPs (bench/flops.py counts them by formula).
        assert predicted["model_flops"] == pytest.approx(rows[name]["step_flops"], rel=0.1)
    assert rows["flatfsdp"]["predicted"]["busy"]["loopback"] > 0 and not rows["floor"]["predicted"]["busy"]


def test_each_rank_s_host_cpu_is_split_by_thread(results):
    """bench/host_cpu.py: every run records each rank's main-thread and
    other-thread CPU of a median step; the summary is their mean over ranks,
    and the prediction table shows it beside the predicted compute."""
    for run in results["runs"]:
        cpu = run["host_cpu_s"]
        assert len(cpu) == 2 and all(main > 0 and other >= 0 for main, other in cpu), run["contender"]
        # One rank's CPU in a step: its main thread cannot run longer than the step itself.
        assert max(main for main, _ in cpu) <= max(run["step_times"]) * 1.05
    rows = results["summary"]["rows"]
    for name, row in rows.items():
        run = next(r for r in results["runs"] if r["contender"] == name)
        assert row["host_cpu_s"] == pytest.approx([sum(rank[i] for rank in run["host_cpu_s"]) / 2 for i in range(2)])
    from flatfsdp.bench.prediction_table import prediction_table
    table = prediction_table(results["summary"])
    main, other = rows["flatfsdp"]["host_cpu_s"]
    assert "main thread / other threads" in table and f"{main:.3f} / {other:.3f}" in table


def test_results_have_every_field(results):
    assert set(results) == {"config", "environment", "summary", "runs"}
    rows = results["summary"]["rows"]
    assert list(rows) == ["floor", "fsdp2", "flatfsdp"]
    for name, row in rows.items():
        assert ROW_FIELDS <= set(row), (name, ROW_FIELDS - set(row))
        assert row["step_s"] > 0 and row["tokens_per_s"] > 0 and row["peak_mb"] > 0
    assert rows["fsdp2"]["time_vs_fsdp2"] == pytest.approx(1.0)
    assert len(results["runs"]) == 3 and all(len(r["step_times"]) == 2 for r in results["runs"])


def test_losses_agree(results):
    rows = results["summary"]["rows"]
    assert all(row["loss_ok"] for row in rows.values())
    assert rows["flatfsdp"]["last_loss"] == pytest.approx(rows["fsdp2"]["last_loss"], abs=1e-4)
    # Same init and rows: the floor's first step is the data-parallel first step.
    assert rows["floor"]["first_loss"] == pytest.approx(rows["fsdp2"]["first_loss"], abs=1e-5)


def _tiny_param_counts() -> tuple[int, int, int]:
    """(all, root-owned, last block) parameter counts of the tiny GPT, from the model itself."""
    model = GPT(GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=64))
    total = sum(p.numel() for p in model.parameters())
    in_blocks = sum(p.numel() for p in model.blocks.parameters())
    return total, total - in_blocks, sum(p.numel() for p in model.blocks[-1].parameters())


def test_flatfsdp_bytes_match_the_analytic_schedule(results):
    total, root, last = _tiny_param_counts()
    comm = results["summary"]["rows"]["flatfsdp"]["comm"]
    assert comm["source"].startswith("engine account")
    measured = {kind: v["bytes"] for kind, v in comm["measured"].items()}
    # ZeRO-3 in fp32: every weight gathered for forward and again for backward,
    # except the root's and the last block's, which stay gathered in between;
    # gradients reduced once.
    assert measured == {"all_gather": (2 * total - root - last) * 4, "reduce_scatter": total * 4}
    assert comm["minimum"] == {"all_gather": 2 * total * 4, "reduce_scatter": total * 4}
    assert comm["total_bytes"] <= comm["min_total_bytes"]
    # The torch-layer counter sees the same traffic: on gloo the engine's
    # gathers and reduce-scatters are pairwise exchanges, one send and one
    # receive of one rank's share (half the full buffer at 2 ranks) each.
    torch_layer, world = comm["torch_layer"], 2
    calls = sum(v["count"] for v in comm["measured"].values())
    share = sum(v["bytes"] for v in comm["measured"].values()) * (world - 1) // world
    assert torch_layer == {"send": {"count": calls, "bytes": share}, "recv": {"count": calls, "bytes": share}}


def test_fsdp2_bytes_counted_at_the_torch_layer(results):
    total, root, _ = _tiny_param_counts()
    measured = {k: v["bytes"] for k, v in results["summary"]["rows"]["fsdp2"]["comm"]["measured"].items()}
    # FSDP2 keeps only the root gathered between forward and backward.
    assert measured == {"all_gather": (2 * total - root) * 4, "reduce_scatter": total * 4}


@pytest.fixture(scope="module")
def untied_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-untied")
    bench_main(TINY + ["--untie-embeddings-and-output-weights", "--contenders", "floor,fsdp2,flatfsdp",
                       "--out", str(out)])
    return json.loads((out / "results.json").read_text())


def test_untied_gpt_trains_alike_and_moves_the_root_lumps_bytes(untied_results):
    """--untie-embeddings-and-output-weights: the token table and the head are
    units of their own (tests/test_root_split.py has the schedule); the
    contenders agree, and flatfsdp moves what the root lump did, except the
    token table's gather and reduction: only the rows of each step's ids travel."""
    assert untied_results["config"]["untied"] is True
    rows = untied_results["summary"]["rows"]
    assert all(row["loss_ok"] for row in rows.values())
    assert rows["flatfsdp"]["last_loss"] == pytest.approx(rows["fsdp2"]["last_loss"], abs=1e-4)
    model = GPT(GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=64, tie_embeddings=False))
    total = sum(p.numel() for p in model.parameters())
    outside_blocks = total - sum(p.numel() for p in model.blocks.parameters())
    last = sum(p.numel() for p in model.blocks[-1].parameters())
    table = model.tok_emb.weight.numel()
    measured = {k: v["bytes"] for k, v in rows["flatfsdp"]["comm"]["measured"].items()}
    assert set(measured) == {"all_gather", "reduce_scatter", "lookup_ids", "lookup_rows", "reduce_rows"}
    assert measured["all_gather"] == (2 * total - outside_blocks - last - table) * 4
    assert measured["reduce_scatter"] == (total - table) * 4
    assert 0 < measured["lookup_rows"] == measured["reduce_rows"] < table * 4  # per-step means: rows vary


def _sum_ranks(x: float) -> float:
    t = torch.tensor([x + dist.get_rank()])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one gives up")
    dist.barrier()  # rank 0 would wait here forever if the launcher did not stop it


def _killed_on_rank_one() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would: no report
    dist.barrier()


def test_launch_returns_rank_zero_value_and_reports_failures():
    assert launch(_sum_ranks, 2, 10.0) == 21.0
    with pytest.raises(RankFailed, match="rank one gives up"):
        launch(_fail_on_rank_one, 2, timeout_s=120)


def test_launch_reports_a_rank_killed_before_it_could_report():
    # Before: NameError inside the launcher's own liveness check.
    with pytest.raises(RankFailed, match=r"rank 1 ---\ndied with exit code -9"):
        launch(_killed_on_rank_one, 2, timeout_s=120)


def test_trace_shows_each_phase_of_the_schedule(tmp_path, capsys):
    from flatfsdp.bench.trace import main as trace_main

    result = trace_main(["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "2", "--vocab-size", "256",
                         "--max-position-embeddings", "32", "--warmup", "1", "--nproc-per-node", "2", "--out",
                         str(tmp_path)])
    # Unit phases carry the unit ("flatfsdp::post_backward (layers.0)"): compare the phase.
    names = [name.split(" (")[0] for _, _, name in result["rows"]]
    # Forward: each block's gather is issued (prefetch) before the host waits
    # for the block it is about to run; backward: the units' reductions, then
    # the end-of-backward wait, then the optimizer.
    for phase in ("flatfsdp::prefetch", "flatfsdp::all_gather", "flatfsdp::wait_unshard",
                  "flatfsdp::post_backward", "flatfsdp::reduce_scatter", "flatfsdp::finish_backward",
                  "flatfsdp::wait_reductions"):
        assert phase in names, phase
    assert names.index("flatfsdp::prefetch") < names.index("flatfsdp::post_backward")
    assert max(i for i, n in enumerate(names) if n == "flatfsdp::finish_backward") < \
        max(i for i, n in enumerate(names) if n.startswith("Optimizer.step"))
    for rank in (0, 1):
        trace = json.loads((tmp_path / f"trace_rank{rank}.json").read_text())
        assert any(e.get("name") == "flatfsdp::all_gather" for e in trace["traceEvents"])
    assert "host blocked on communication" in capsys.readouterr().out
