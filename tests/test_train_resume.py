"""`flatfsdp train` on 2 real ranks (gloo): resume is bitwise, and the flags
that should not change the numbers do not.

One launch runs every training run of this module in sequence inside the same
two processes (flatfsdp.train.loop.run is what each rank of the command runs),
so the module costs one process start-up rather than one per run.
"""

from __future__ import annotations

import json

import pytest

from flatfsdp.launch import launch
from flatfsdp.train.loop import run
from flatfsdp.train.options import parse_options

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--micro-batch-size", "4", "--eval-iters", "1", "--log-interval", "2", "--no-progress"]


def _runs(jobs: dict[str, list[str]]) -> dict[str, dict]:
    """Every rank: each named run in order (later ones may load what earlier ones saved)."""
    return {name: run(parse_options(argv)) for name, argv in jobs.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")

    def job(name: str, *flags: str) -> list[str]:
        return TINY + ["--run-dir", str(root / name), *flags]

    ckpt, bf16_ckpt, async_ckpt = str(root / "ckpt"), str(root / "bf16-ckpt"), str(root / "async-ckpt")
    jobs = {
        "straight": job("straight", "--train-iters", "8"),
        "first_half": job("first_half", "--train-iters", "8", "--exit-interval", "4", "--save", ckpt),
        "second_half": job("second_half", "--train-iters", "8", "--load", ckpt),
        "meta": job("meta", "--train-iters", "8", "--init-model-with-meta-device", "--save", str(root / "meta-ckpt"),
                    "--save-interval", "3"),
        "bf16_straight": job("bf16_straight", "--train-iters", "6", "--bf16", "--grad-reduce-in-bf16",
                             "--recompute", "--data-parallel-sharding-strategy", "optim"),
        "bf16_first": job("bf16_first", "--train-iters", "6", "--bf16", "--grad-reduce-in-bf16", "--recompute",
                          "--data-parallel-sharding-strategy", "optim", "--exit-interval", "3", "--save", bf16_ckpt),
        "bf16_second": job("bf16_second", "--train-iters", "6", "--bf16", "--grad-reduce-in-bf16", "--recompute",
                           "--data-parallel-sharding-strategy", "optim", "--load", bf16_ckpt),
        "one_pass": job("one_pass", "--train-iters", "4", "--micro-batch-size", "4", "--global-batch-size", "8"),
        "accumulated": job("accumulated", "--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "8",
                           "--calculate-per-token-loss", "--data-parallel-sharding-strategy", "optim_grads"),
        "async_first": job("async_first", "--train-iters", "8", "--exit-interval", "5", "--save", async_ckpt,
                           "--save-interval", "2", "--async-save"),
        "async_second": job("async_second", "--train-iters", "8", "--load", async_ckpt),
        "other_strategy": job("other_strategy", "--train-iters", "8", "--load", ckpt,
                              "--data-parallel-sharding-strategy", "no_shard"),
    }
    return {"root": root, **launch(_runs, 2, jobs, timeout_s=300)}


def test_resume_continues_with_bitwise_identical_losses(results):
    straight = results["straight"]["losses"]
    first, second = results["first_half"], results["second_half"]
    assert len(straight) == 8 and first["stopped"] == "exit_interval" and first["last_step"] == 4
    assert second["first_step"] == 5 and second["last_step"] == 8
    assert first["losses"] + second["losses"] == straight  # exact, not approximate
    assert results["second_half"]["eval_loss"] == results["straight"]["eval_loss"]


def test_bf16_resume_with_recompute_and_zero1_is_bitwise_too(results):
    assert results["bf16_first"]["losses"] + results["bf16_second"]["losses"] == results["bf16_straight"]["losses"]


def test_meta_device_init_trains_exactly_like_normal_init(results):
    assert results["meta"]["losses"] == results["straight"]["losses"]


def test_accumulation_with_per_token_loss_matches_one_pass_of_the_same_global_batch(results):
    one_pass, accumulated = results["one_pass"], results["accumulated"]
    assert accumulated["losses"] == pytest.approx(one_pass["losses"], rel=1e-4)
    assert accumulated["losses"] != one_pass["losses"]  # really a different path (sum, no_sync, divide)


def test_checkpoint_resumes_under_another_strategy(results):
    resumed, straight = results["other_strategy"]["losses"], results["straight"]["losses"][4:]
    assert resumed == pytest.approx(straight, rel=1e-4)


def test_loss_goes_down_and_every_unit_is_sharded(results):
    s = results["straight"]
    assert s["losses"][-1] < s["losses"][0] - 0.5
    assert s["sharded_units"] == 3  # two blocks and the root
    assert len(s["peak_rss_mb_per_rank"]) == 2 and min(s["peak_rss_mb_per_rank"]) > 0


def test_run_directory_holds_the_json_log_and_the_loss_curve(results):
    run_dir = results["root"] / "straight"
    assert sorted(p.name for p in run_dir.iterdir()) == ["log.json", "loss.png"]
    log = json.loads((run_dir / "log.json").read_text())
    assert log["config"]["world_size"] == 2 and log["config"]["hidden_size"] == 32
    assert [s["step"] for s in log["steps"]] == list(range(1, 9))
    assert [s["loss"] for s in log["steps"]] == results["straight"]["losses"]
    assert all(s["tokens_per_s"] > 0 for s in log["steps"])
    assert [m["step"] for m in log["memory"]][:4] == [1, 2, 4, 6]  # first step, then every --log-interval 2
    assert all(len(m["ranks"]) == 2 and m["ranks"][1]["rss_mb"] > 0 for m in log["memory"])
    assert log["evals"] == [{"step": 8, "loss": results["straight"]["eval_loss"]}]
    assert log["summary"]["last_step"] == 8 and not log["summary"]["interrupted"]
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_save_interval_saves_along_the_way_and_at_the_end(results):
    log = json.loads((results["root"] / "meta" / "log.json").read_text())
    checkpoint = str(results["root"] / "meta-ckpt")
    assert log["events"] == [{"step": s, "event": f"save: checkpoint {checkpoint}"} for s in (3, 6, 8)]
    assert results["meta"]["checkpoint"] == checkpoint


def test_async_saves_publish_in_order_and_resume_bitwise(results):
    """--async-save every 2 steps, stopping at 5: the saves of steps 2 and 4 are
    published while training goes on (or at the next save), the one of step 5
    before the run ends; resuming from it continues bit for bit."""
    first, second = results["async_first"], results["async_second"]
    assert first["stopped"] == "exit_interval" and second["first_step"] == 6
    assert first["losses"] + second["losses"] == results["straight"]["losses"]
    log = json.loads((results["root"] / "async_first" / "log.json").read_text())
    checkpoint = str(results["root"] / "async-ckpt")
    steps = [e["step"] for e in log["events"]]
    assert steps == [2, 4, 5], log["events"]
    assert all(e["event"].startswith(f"{why}: checkpoint {checkpoint} (async: training paused ")
               for e, why in zip(log["events"], ["save", "save", "exit_interval"]))
