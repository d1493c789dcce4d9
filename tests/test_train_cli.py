"""`flatfsdp train` as a person runs it: Ctrl-C in the middle of a run, and bad
flags. The Ctrl-C test starts the real command as a subprocess and sends it a
real SIGINT; the flag tests call the command's main() and check what it prints
and its exit status (every one of them fails before any rank starts)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from flatfsdp.checkpoint import MANIFEST_NAME
from flatfsdp.launch import launch
from flatfsdp.train import main
from flatfsdp.train.loop import run
from flatfsdp.train.options import parse_options

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--micro-batch-size", "4", "--eval-iters", "1", "--no-progress"]
LONG = ["--train-iters", "100000", "--lr-warmup-iters", "2"]  # never finishes by itself


def _start(argv: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "flatfsdp.train", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _wait_for_step(proc: subprocess.Popen, step: int, timeout_s: float = 120) -> list[str]:
    deadline, lines = time.monotonic() + timeout_s, []
    for line in proc.stdout:
        lines.append(line)
        match = re.match(r"step\s+(\d+)/", line)
        if match and int(match.group(1)) >= step:
            return lines
        assert time.monotonic() < deadline, "".join(lines)
    raise AssertionError("the run ended before reaching step %d:\n%s%s" % (step, "".join(lines), proc.stderr.read()))


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A real `flatfsdp train` run stopped by SIGINT after its third step, with
    an async save started after every step: the save in flight when Ctrl-C
    arrives is published, then the interrupt checkpoint is taken and published."""
    run_dir = tmp_path_factory.mktemp("interrupted")
    proc = _start(TINY + LONG + ["--log-interval", "1", "--run-dir", str(run_dir), "--save", str(run_dir / "checkpoint"),
                                 "--save-interval", "1", "--async-save"])
    try:
        _wait_for_step(proc, 3)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return {"dir": run_dir, "code": proc.returncode, "stdout": out, "stderr": err}


def test_ctrl_c_saves_a_checkpoint_and_exits_130_with_one_line(interrupted):
    assert interrupted["code"] == 130, interrupted["stderr"]
    lines = interrupted["stderr"].strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in interrupted["stderr"], interrupted["stderr"]
    checkpoint = interrupted["dir"] / "checkpoint"
    assert re.fullmatch(rf"flatfsdp train: interrupted at step \d+; checkpoint saved to {re.escape(str(checkpoint))} "
                        rf"\(continue with --load {re.escape(str(checkpoint))}\)", lines[0]), lines[0]
    assert (checkpoint / MANIFEST_NAME).is_file()
    log = json.loads((interrupted["dir"] / "log.json").read_text())
    assert log["summary"]["interrupted"] and log["summary"]["stopped"] == "interrupt"
    assert log["events"][-1]["event"].startswith("interrupt: checkpoint")


def _two_runs(resume_argv: list[str], straight_argv: list[str]) -> tuple[dict, dict]:
    return run(parse_options(resume_argv)), run(parse_options(straight_argv))


def test_the_interrupt_checkpoint_resumes_exactly_where_it_stopped(interrupted, tmp_path):
    log = json.loads((interrupted["dir"] / "log.json").read_text())
    before = [s["loss"] for s in log["steps"]]
    stopped_at = len(before)
    until = ["--exit-interval", str(stopped_at + 2)]
    resumed, straight = launch(_two_runs, 2,
                               TINY + LONG + until + ["--load", str(interrupted["dir"] / "checkpoint"),
                                                      "--run-dir", str(tmp_path / "resumed")],
                               TINY + LONG + until + ["--run-dir", str(tmp_path / "straight")], timeout_s=300)
    assert resumed["first_step"] == stopped_at + 1 and resumed["last_step"] == stopped_at + 2
    assert before + resumed["losses"] == straight["losses"]  # bitwise: data position and state restored


def _error_of(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("flatfsdp train: error: ")
    return err


@pytest.mark.parametrize("argv, expected", [
    (["--data-parallel-sharding-strategy", "zero9"], "unknown strategy 'zero9'"),
    (["--data-parallel-sharding-strategy", "4"], "unknown strategy '4'"),
    (["--nproc-per-node", "2", "--micro-batch-size", "4", "--global-batch-size", "12"],
     "--global-batch-size 12 is not a multiple of --micro-batch-size 4 x 2 data-parallel ranks = 8"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be at least 1"),
    (["--hidden-size", "30", "--num-attention-heads", "4"], "not divisible"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--recompute", "sometimes"], "invalid choice: 'sometimes'"),
    (["--hf-model", "--init-model-with-meta-device"], "--init-model-with-meta-device needs"),
    (["--save-interval", "5"], "--save-interval needs --save DIR"),
])
def test_bad_flags_get_one_line_and_status_2(capsys, argv, expected):
    assert expected in _error_of(capsys, argv)


def test_load_of_a_missing_directory(capsys, tmp_path):
    err = _error_of(capsys, ["--load", str(tmp_path / "nowhere")])
    assert "the directory does not exist" in err


def test_load_of_another_models_checkpoint(capsys, interrupted):
    checkpoint = str(interrupted["dir"] / "checkpoint")
    other = [a if a != "32" else "48" for a in TINY]  # hidden size 48 instead of 32 (and seq 48)
    err = _error_of(capsys, other + ["--load", checkpoint])
    assert f"--load {checkpoint} holds a different model" in err and "(256, 32) there, (256, 48) here" in err


def test_hf_model_without_transformers(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now fails
    err = _error_of(capsys, ["--hf-model"])
    assert "--hf-model needs the transformers package: pip install 'flatfsdp[hf]'" in err


def test_the_installed_command_fails_the_same_way():
    done = subprocess.run([sys.executable, "-m", "flatfsdp.cli", "train", "--data-parallel-sharding-strategy", "7"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "flatfsdp train: error: argument --data-parallel-sharding-strategy: unknown strategy '7': "
        "use 0-3 or one of no_shard, optim, optim_grads, optim_grads_params"]


def test_strategies_by_number_and_name():
    for value, name in [("0", "no_shard"), ("1", "optim"), ("2", "optim_grads"), ("3", "optim_grads_params"),
                        ("OPTIM_GRADS", "optim_grads")]:
        assert parse_options(["--data-parallel-sharding-strategy", value]).data_parallel_sharding_strategy == name
