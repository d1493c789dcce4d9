"""`flatfsdp estimate`: the engine run as rank 0 of a fake world on fake tensors.

The central test runs the same step for real on 1, 2 and 4 gloo ranks and
holds the estimate to the CPU allocator's own count: persistent bytes equal by
role, traffic equal by mesh dimension, the peak within 5% (docs/scale.md)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from flatfsdp.estimator import Layout, estimate, resolve_model
from flatfsdp.estimator.deepspeed_formulas import deepspeed_model_states, model_counts
from flatfsdp.estimator.live_bytes import LiveBytes
from flatfsdp.estimator.rank_step import STRATEGIES
from flatfsdp.estimator.verify import compare
from harness import run_ranks

STEP = dict(seq_len=128, micro_batch=4)
LAYOUTS = ([Layout(world=w, strategy=s, **STEP) for w in (1, 2, 4) for s in STRATEGIES]
           + [Layout(world=4, replicas=2, **STEP), Layout(world=4, replicas=2, outer_sharding=True, **STEP),
              Layout(world=2, strategy="optim", bf16=True, **STEP),
              Layout(world=2, strategy="optim_grads_params", bf16=True, **STEP),
              Layout(world=4, tp=2, **STEP), Layout(world=2, tp=2, strategy="optim", **STEP)])


@pytest.fixture(scope="module")
def checked():
    return compare("gpt-tiny", LAYOUTS)


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[f"{l.describe()}-w{l.world}{'-bf16' if l.bf16 else ''}"
                                                            for l in LAYOUTS])
def test_estimate_holds_against_the_real_run(checked, index):
    c = checked[index]
    assert c.predicted.persistent == c.measured.persistent  # by role, to the byte
    assert c.predicted.comm == c.measured.comm              # by mesh dimension and collective, to the byte
    assert c.predicted.start == pytest.approx(c.measured.start, abs=64)
    assert abs(c.peak_error) <= 0.05, (c.predicted.peak, c.measured.peak)


def test_the_check_covers_sharded_layouts(checked):
    """The layouts differ where they should: the check is not comparing one number 14 times."""
    persistent = {(c.layout.world, c.layout.describe(), c.layout.bf16): sum(c.measured.persistent.values())
                  for c in checked}
    assert persistent[(4, "ZeRO-3", False)] * 4 == pytest.approx(persistent[(1, "ZeRO-3", False)], rel=0.01)
    assert persistent[(4, "HFSDP 2x2 ZeRO-3", False)] < persistent[(4, "HSDP 2x2 ZeRO-3", False)]
    hsdp = next(c for c in checked if c.layout.describe() == "HSDP 2x2 ZeRO-3")
    assert set(hsdp.predicted.comm) == {"dp_shard", "dp_outer"}
    tp = next(c for c in checked if c.layout.describe() == "ZeRO-3 TP2" and c.layout.world == 4)
    # Tensor parallelism splits the MLPs further: between DP over 2 and DP over 4.
    assert persistent[(4, "ZeRO-3", False)] < persistent[(4, "ZeRO-3 TP2", False)] < persistent[(2, "ZeRO-3", False)]
    assert set(tp.predicted.comm) == {"dp_shard"}  # the engine reduces over data parallelism only


# ---- the meter -----------------------------------------------------------------------------------


def _metered_sequence():
    x = torch.ones(1000)            # 4,000 bytes, known
    buffer = torch.empty(500)       # 2,000 bytes, resized in place like an engine buffer
    unknown = torch.ones(1000)      # 4,000 bytes alive but not declared
    with LiveBytes([x], [buffer]) as meter:
        y = x * 2                   # +4,000
        z = y + unknown             # +4,000; ``unknown`` adopted into the start
        del y                       # -4,000
        buffer.untyped_storage().resize_(0)  # -2,000, no op announces it
        w = z * 3                   # +4,000
        buffer.untyped_storage().resize_(2000)
        w.add_(1)                   # the buffer is back
    del z, w
    return meter


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_live_bytes_follows_storages_views_and_resizes(fake):
    with FakeTensorMode() if fake else torch.device("cpu"):
        meter = _metered_sequence()
    assert meter.start == 4000 + 2000 + 4000
    # After z: x, buffer, unknown, y, z (and again after w, with y freed and the buffer back).
    assert meter.peak_total == 4000 + 2000 + 4000 + 4000 + 4000
    assert meter.other_new_peak == 8000
    assert meter.engine_transient_peak == 0


def test_views_are_not_new_memory():
    x = torch.ones(1000)
    with LiveBytes([x], []) as meter:
        x[10:20].view(2, 5)
        x.t()
    assert meter.peak_total == meter.start == 4000


# ---- the command ---------------------------------------------------------------------------------


def _estimate_json(*argv: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "flatfsdp.cli", "estimate", "--json", *argv],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_one_table_over_world_sizes_strategies_and_hsdp():
    rows = _estimate_json("--model", "gpt-tiny", "--world-sizes", "8,64", "--data-parallel-sharding-strategy", "1,3",
                          "--seq-length", "64")["rows"]
    by = {(r["layout"]["world"], r["layout"]["strategy"]): r for r in rows}
    assert len(rows) == 4
    z3_8, z3_64 = by[8, "optim_grads_params"], by[64, "optim_grads_params"]
    # ZeRO-3 state is split 8 ways further (up to padding); traffic per rank stays.
    assert sum(z3_8["persistent"].values()) / sum(z3_64["persistent"].values()) == pytest.approx(8, rel=0.02)
    assert z3_64["comm"]["world"]["all_gather"] == pytest.approx(z3_8["comm"]["world"]["all_gather"], rel=0.02)
    # ZeRO-1 keeps the model weights and gradients whole: they do not shrink (beyond padding).
    z1_8, z1_64 = by[8, "optim"], by[64, "optim"]
    assert z1_64["persistent"]["gradients"] == pytest.approx(z1_8["persistent"]["gradients"], rel=0.02)
    assert z1_64["persistent"]["optimizer state"] < z1_8["persistent"]["optimizer state"] / 4
    for r in rows:
        assert r["peak"] >= r["start"] + r["activations_peak"] > r["start"] > 0

    hsdp = _estimate_json("--model", "gpt-tiny", "--world-sizes", "64", "--hsdp-shard", "8", "--seq-length", "64")
    comm = hsdp["rows"][0]["comm"]
    assert set(comm) == {"dp_shard", "dp_outer"}
    # The outer all-reduce carries each rank's reduced chunk: 1/8 of the gradients reduce-scattered.
    assert comm["dp_outer"]["all_reduce"] * 8 == pytest.approx(comm["dp_shard"]["reduce_scatter"], rel=0.02)
    assert sum(hsdp["rows"][0]["persistent"].values()) == pytest.approx(sum(z3_8["persistent"].values()), rel=0.01)


def test_llama_3_70b_at_1024_ranks_in_little_memory():
    """Built on the meta device, run on fake tensors: a 70B model at 1,024 ranks
    needs no more than the engine's own bookkeeping."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    row = _estimate_json("--model", "llama-3-70b", "--world-sizes", "1024", "--bf16", "--seq-length", "256")["rows"][0]
    child_peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    params = row["params"]
    assert 70.0e9 < params < 71.0e9
    share = params / 1024
    persistent = row["persistent"]
    assert 4 * share <= persistent["main weights"] <= 4 * share * 1.01   # fp32 main weights
    assert 2 * share <= persistent["model weights"] <= 2 * share * 1.01  # bf16 chunks gathered from
    assert 8 * share <= persistent["optimizer state"] <= 8 * share * 1.01
    assert row["comm"]["world"]["reduce_scatter"] == pytest.approx(4 * params, rel=0.01)
    if child_peak_kib > before:  # this child set the children's high-water mark
        assert child_peak_kib < 4 * 2 ** 20, f"{child_peak_kib / 2 ** 20:.1f} GiB"


@pytest.mark.parametrize("argv, expected", [
    (["--model", "no-such-model"], "--model no-such-model: not a built-in model"),
    (["--model", "gpt-tiny", "--hfsdp"], "--hfsdp needs --hsdp-shard"),
    (["--model", "gpt-tiny", "--world-sizes", "12", "--hsdp-shard", "8"], "world 12 is not a multiple of the HSDP "
                                                                          "shard size 8"),
    (["--model", "gpt-tiny", "--data-parallel-sharding-strategy", "5"],
     "argument --data-parallel-sharding-strategy: unknown strategy '5'"),
    (["--model", "gpt-tiny", "--world-sizes", "8,x"], "--world-sizes: 8,x: expected comma-separated integers"),
    (["--model", "gpt-tiny", "--world-sizes", "16", "--check"], "--check runs every rank on this machine"),
    (["--model", "no_such_module:build", "--units", "Block"], "cannot import 'build' from 'no_such_module'"),
])
def test_bad_input_gets_one_line_and_status_2(argv, expected):
    done = subprocess.run([sys.executable, "-m", "flatfsdp.cli", "estimate", *argv], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], done.stderr


def _estimate_under_a_process_group(rank, world):
    with pytest.raises(RuntimeError, match="a process without a process group"):
        estimate("gpt-tiny", [8])
    return True


def test_refuses_to_run_inside_a_process_group():
    assert run_ranks(_estimate_under_a_process_group, 1) == [True]


def test_deepspeed_counts_unique_parameters_and_the_largest_module():
    model = resolve_model("gpt-tiny").build()
    params, largest = model_counts(model)
    assert params == sum(p.numel() for p in model.parameters())  # the tied embedding once
    fc = model.blocks[0].mlp.fc  # 128 x 512 and its bias: more than the 256 x 128 embedding
    assert largest == fc.weight.numel() + fc.bias.numel()
    assert deepspeed_model_states(3, params, largest, 8) == 4 * largest + 18 * params // 8
    assert deepspeed_model_states(0, params, largest, 8) is None
