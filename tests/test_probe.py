"""The probe of this machine (flatfsdp.estimator.probe) and how its figures
price the ops of a sharded step. No time is asserted: what a probe measures
varies; what is deterministic is which ops it saw, that every kind of
collective got a cost, and the pricing arithmetic."""

from __future__ import annotations

import json

import pytest
import torch

from device_checks_estimator import TINY_LLAMA
from flatfsdp.bench.options import parse
from flatfsdp.bench.prediction import engine_overhead, engine_step, probe_step, workload_key
from flatfsdp.estimator.compute_cost import Measured, OpRates, Throughput
from flatfsdp.estimator.devices import DEVICES
from flatfsdp.estimator.op_timer import RATE_MIN_BYTES
from flatfsdp.estimator.probe import MachineProbe, probe
from flatfsdp.estimator.schedule_trace import Op

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--vocab-size", "256",
        "--max-position-embeddings", "32", "--seq-length", "32", "--micro-batch-size", "2"]


def test_a_probe_times_the_models_ops_and_what_moving_bytes_costs():
    cfg = parse(TINY)[0]
    machine = probe([(probe_step, (cfg.as_dict(),))], steps=2, comm_mbytes=4, workload_s=0.05,
                    engine_workloads=[(workload_key(cfg), engine_step, (cfg.as_dict(),))])
    for rates in (machine.alone, machine.side_by_side):
        names = {key[0] for key in rates.by_key}
        assert {"addmm", "mm", "_foreach_add_"} <= names  # forward, backward, AdamW's foreach step
        assert all(t > 0 for t in rates.by_key.values())
        assert rates.per_op_s > 0
    assert machine.ranks == 2 and machine.loopback_gbytes_s > 0 and machine.loopback_busy_gbytes_s > 0
    assert set(machine.cpu_s_per_byte) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert all(v >= 0 for v in machine.cpu_s_per_byte.values())
    # The engine's own step at one rank, and what it costs beyond its ops (never negative).
    assert set(machine.engine_step_s) == {workload_key(cfg)} and machine.engine_step_s[workload_key(cfg)] > 0
    # Timed at both ends of the probe, the faster kept (a passing load only adds time).
    each = machine.engine_step_each_s[workload_key(cfg)]
    assert len(each) == 2 and machine.engine_step_s[workload_key(cfg)] == min(each)
    assert engine_overhead(cfg, machine) >= 0
    # The probe is kept as JSON (the bench's --probe-file) and comes back the same.
    again = MachineProbe.from_json(json.loads(json.dumps(machine.to_json())))
    assert again.side_by_side.by_key == machine.side_by_side.by_key and again.load == machine.load


def test_an_op_is_priced_by_its_signature_then_its_name_then_its_class():
    rates = OpRates(by_key={("mm", ((4, 4), "float32")): 0.5}, per_unit={"add": 1e-9},
                    per_op_s=0.01, flop_s=1e-6, byte_s=2e-9)
    measured = Measured(rates, slowdown=2.0)
    known = Op("mm", 128, 96, ("mm", ((4, 4), "float32")), "forward")
    assert measured.seconds(known) == pytest.approx((0.5 + 0.01) * 2)
    by_name = Op("add", 0, 1000, ("add", ((250,), "float32")), "engine")
    assert measured.seconds(by_name) == pytest.approx((1000 * 1e-9 + 0.01) * 2)
    matmul = Op("bmm", 1000, 100, ("bmm",), "forward")
    assert measured.seconds(matmul) == pytest.approx((1000 * 1e-6 + 0.01) * 2)
    other = Op("round", 0, 500, ("round",), "engine")
    assert measured.seconds(other) == pytest.approx((500 * 2e-9 + 0.01) * 2)
    assert measured.seconds(Op("view", 0, 0, ("view",), "engine")) == pytest.approx(0.01 * 2)


def test_small_ops_do_not_set_a_rate_for_large_ones():
    """A scalar division costs its fixed cost; a buffer's division is priced by work."""
    from flatfsdp.estimator.op_timer import rates_from

    tiny = Op("div", 0, 16, ("div", ((1,), "float32")), "forward")
    large = Op("add", 0, RATE_MIN_BYTES, ("add", ((RATE_MIN_BYTES // 4,), "float32")), "forward")
    rates = rates_from([(tiny, 1e-5), (large, 1e-4)], plain_step_s=0.0, per_op_s=1e-6)
    assert "div" not in rates.per_unit
    assert rates.per_unit["add"] == pytest.approx(1e-4 / RATE_MIN_BYTES)
    assert rates.byte_s == pytest.approx(1e-4 / RATE_MIN_BYTES)


def test_ops_timed_on_a_device_cost_the_longer_of_kernel_and_dispatch():
    """On an accelerator the host dispatches the next op while the device runs
    this one: a long kernel hides its dispatch, a tiny one costs its dispatch;
    on the CPU the two add up. The step's fixed cost is what the ops leave."""
    from flatfsdp.estimator.op_timer import rates_from

    long_op = Op("mm", 10**9, 10**6, ("mm", ((64, 64), "bfloat16")), "forward")
    tiny = Op("add", 0, 8, ("add", ((2,), "float32")), "forward")
    timed = [(long_op, 1e-3), (tiny, 1e-6)]
    device = rates_from(timed, plain_step_s=2e-3, per_op_s=5e-6, overlapped=True)
    host = rates_from(timed, plain_step_s=2e-3, per_op_s=5e-6)
    assert Measured(device).seconds(long_op) == pytest.approx(1e-3)
    assert Measured(device).seconds(tiny) == pytest.approx(5e-6)
    assert Measured(host).seconds(long_op) == pytest.approx(1e-3 + 5e-6)
    assert Measured(host).seconds(tiny) == pytest.approx(6e-6)
    assert device.step_overhead_s == pytest.approx(2e-3 - 1e-3 - 5e-6)
    assert host.step_overhead_s == pytest.approx(2e-3 - 1e-3 - 1e-6 - 2 * 5e-6)


def test_a_device_roofline_takes_the_longer_of_flops_and_bytes():
    h100 = Throughput(DEVICES["h100"])
    matmul = Op("mm", 10**12, 10**6, ("mm", ((1, 1), "bfloat16")), "forward")
    assert h100.seconds(matmul) == pytest.approx(1e12 / (989e12 * 0.7))
    copy = Op("copy_", 0, 10**9, ("copy_", ((1,), "bfloat16")), "engine")
    assert h100.seconds(copy) == pytest.approx(1e9 / (3350e9 * 0.8))
    assert h100.seconds(Op("add", 0, 8, ("add", ((1,), "float32")), "forward")) == pytest.approx(4e-6)


def test_a_roofline_prices_an_op_in_the_dtype_of_its_largest_argument():
    """Attention's backward takes its fp32 log-sum-exp first and bf16 queries,
    keys and values after: it computes in bf16 (priced at fp32 it was 0.66 s
    of a predicted 1.0 s H200 step measured at 0.37 s)."""
    h200 = Throughput(DEVICES["h200"])
    q = ((4, 32, 4096, 64), "bfloat16")
    backward = Op("_scaled_dot_product_flash_attention_backward", 10**13, 10**6,
                  ("_scaled_dot_product_flash_attention_backward", ((4, 32, 4096), "float32"), q, q, q), "backward")
    bf16_peak = DEVICES["h200"].matmul_tflops["bfloat16"] * 1e12
    assert h200.seconds(backward) == pytest.approx(1e13 / (bf16_peak * 0.5))


def test_an_unsafe_view_moves_no_bytes():
    import torch

    from flatfsdp.estimator.schedule_trace import describe_op

    x = torch.ones(64, 64)
    op = describe_op(torch.ops.aten._unsafe_view.default, (x, [4096]), {}, x.view(4096), "forward")
    assert (op.flops, op.nbytes) == (0, 0)
    assert Throughput(DEVICES["h200"]).seconds(op) == 0.0


def test_the_schedule_is_traced_on_the_ops_the_device_runs():
    """The fake world's step runs the very ops the device runs: on a GPU, a trace
    of the CPU's ops (RMSNorm in five passes, the CPU's attention, other casts)
    priced by a probe of the GPU predicted its 0.37 s step 18% long."""
    from flatfsdp.bench.prediction import trace_run
    from flatfsdp.estimator.schedule_trace import tracing

    cfg, _ = parse(TINY_LLAMA)
    step = probe_step(cfg.as_dict())
    step()
    with tracing() as real:
        step()
    fake = trace_run(cfg, "floor", "cpu")
    assert [op.key for op in fake.ops] == [op.key for op in real.ops]
    assert any(op.name == "_scaled_dot_product_flash_attention_for_cpu" for op in fake.ops)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host traces on CUDA itself")
def test_a_device_the_host_cannot_trace_on_falls_back_to_the_hosts_ops_and_says_so():
    from flatfsdp.bench.prediction import trace_for_prediction

    cfg, _ = parse(TINY_LLAMA)
    trace, note = trace_for_prediction(cfg, "floor", "cuda")
    assert "traced on fake CPU tensors" in note and "cuda" in note
    assert any(op.name == "_scaled_dot_product_flash_attention_for_cpu" for op in trace.ops)
    assert trace_for_prediction(cfg, "floor", "cpu")[1] == ""


def test_a_probe_of_one_accelerator_prices_every_rank_as_that_device_on_the_named_links():
    """One GPU measures no link (its probe runs one rank): a layout of many
    ranks is each such a device, joined by the cluster's links -- not the
    probe's loopback, which it never measured (priced at 0 GB/s it divided
    by zero on an H200)."""
    from flatfsdp.estimator.estimate import estimate
    from flatfsdp.estimator.fabric import PRESETS
    from flatfsdp.estimator.predict import Links, probed, time_rows

    rows = estimate("gpt-tiny", [1, 8], micro_batch=2, seq_len=64, trace=True)
    rates = OpRates(per_op_s=1e-6, overlapped=True, flop_s=1e-12, byte_s=1e-11)  # ops timed on a device
    machine = MachineProbe(alone=rates, side_by_side=rates, ranks=1, cores=16)
    cluster = Links(PRESETS["nvlink-h100"], PRESETS["ib-400"], 4)
    compute, links = probed(machine, cluster)
    assert links is cluster
    world1, world8 = time_rows(rows, compute, links)
    assert compute(rows[1][0]).slowdown == 1.0  # its own device, not a share of the probed one
    assert type(links.fabric(rows[1][0])).__name__ == "Cluster"
    # ZeRO-3 over 8 moves its weights over two nodes of 4: the step takes longer than one rank's.
    assert world8.step_s > world1.step_s > 0
