"""Reliability, files: nothing a user made is deleted, moved or overwritten, and
every path is checked before a run starts (docs/reliability.md, outcome 1).
Real files, real commands; no process group needed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from flatfsdp import checkpoint as ckpt
from flatfsdp.checkpoint import MANIFEST_NAME
from flatfsdp.checkpoint.cli import main as checkpoint_cli
from flatfsdp.checkpoint.errors import CheckpointError
from flatfsdp.train import main as train_main


def _state(value: float = 1.0) -> dict:
    return {"model": {"w": torch.full((4, 3), value), "b": torch.arange(3.0)}}


def _user_folder(path) -> dict:
    path.mkdir()
    (path / "notes.txt").write_text("my notes")
    (path / "sub").mkdir()
    (path / "sub" / "data.bin").write_bytes(b"\x00\x01")
    return _snapshot(path)


def _snapshot(path) -> dict:
    return {os.path.relpath(os.path.join(root, f), path): open(os.path.join(root, f), "rb").read()
            for root, _dirs, files in os.walk(path) for f in files}


def test_save_refuses_a_folder_that_is_not_a_checkpoint_and_leaves_it_alone(tmp_path):
    before = _user_folder(tmp_path / "mine")
    with pytest.raises(CheckpointError, match="is a directory that is not a flatfsdp checkpoint"):
        ckpt.save(_state(), tmp_path / "mine")
    assert _snapshot(tmp_path / "mine") == before
    assert sorted(os.listdir(tmp_path)) == ["mine"]  # no temporary directory left either


def test_save_refuses_a_file_and_neither_renames_nor_changes_it(tmp_path):
    (tmp_path / "weights").write_text("precious")
    with pytest.raises(CheckpointError, match="it is a file"):
        ckpt.save(_state(), tmp_path / "weights")
    assert sorted(os.listdir(tmp_path)) == ["weights"] and (tmp_path / "weights").read_text() == "precious"


def test_save_replaces_its_own_checkpoint_and_an_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    ckpt.save(_state(1.0), tmp_path / "empty")
    ckpt.save(_state(2.0), tmp_path / "empty")  # a checkpoint is replaced atomically, as before
    loaded = {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}}
    ckpt.load(loaded, tmp_path / "empty")
    assert torch.equal(loaded["model"]["w"], torch.full((4, 3), 2.0))


def test_only_leftovers_named_by_flatfsdp_are_cleaned_up(tmp_path):
    (tmp_path / "ck.tmp-mine").mkdir()  # a user's folder that merely looks similar
    (tmp_path / "ck.old-backup").write_text("keep me")
    (tmp_path / "ck.tmp-0123456789ab").mkdir()  # debris of an interrupted save: ours
    ckpt.save(_state(), tmp_path / "ck")
    assert sorted(os.listdir(tmp_path)) == ["ck", "ck.old-backup", "ck.tmp-mine"]


def test_checkpoint_import_refuses_a_user_folder(tmp_path, capsys):
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    before = _user_folder(tmp_path / "mine")
    with pytest.raises(SystemExit) as exit_:
        checkpoint_cli(["import", str(tmp_path / "w.pt"), str(tmp_path / "mine")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "not a flatfsdp checkpoint" in err and _snapshot(tmp_path / "mine") == before


def test_a_data_file_dropped_from_the_manifest_is_refused(tmp_path):
    ckpt.save(_state(), tmp_path / "ck")
    path = tmp_path / "ck" / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    data = next(n for n in manifest["files"] if n.endswith(".distcp"))
    del manifest["files"][data]  # the file is then never hash-checked...
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"{data} is read by the checkpoint but not listed in its manifest"):
        ckpt.load({"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}}, tmp_path / "ck")


def _train_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        train_main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_train_save_dot_is_refused_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    before = _user_folder(tmp_path / "work")
    monkeypatch.chdir(tmp_path / "work")
    err = _train_error(capsys, ["--save", ".", "--run-dir", str(tmp_path / "run")])
    assert "--save .: refusing to save a checkpoint to" in err and "not a flatfsdp checkpoint" in err
    assert _snapshot(tmp_path / "work") == before


@pytest.mark.parametrize("argv, expected", [
    (["--lr", "-1"], "--lr must be a finite number greater than 0, got -1.0"),
    (["--lr", "nan"], "--lr must be a finite number greater than 0, got nan"),
    (["--weight-decay", "-0.1"], "--weight-decay must be a finite number at least 0"),
    (["--clip-grad", "-1"], "--clip-grad must be a finite number at least 0"),
    (["--clip-grad", "inf"], "--clip-grad must be a finite number at least 0"),
    (["--timeout", "0"], "--timeout must be a finite number greater than 0"),
    (["--seq-length", "100000"], "--seq-length 100000 is too long for the shipped text"),
    (["--on-nonfinite", "ignore"], "invalid choice: 'ignore'"),
])
def test_bad_numbers_get_one_line_and_status_2(capsys, tmp_path, argv, expected):
    assert expected in _train_error(capsys, argv + ["--run-dir", str(tmp_path / "run")])


def test_unusable_paths_are_reported_at_start(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    err = _train_error(capsys, ["--run-dir", str(tmp_path / "file" / "run")])
    assert f"--run-dir {tmp_path / 'file' / 'run'} cannot be created or written (Not a directory)" in err
    err = _train_error(capsys, ["--run-dir", str(tmp_path / "file")])
    assert "is a file, not a directory" in err
    err = _train_error(capsys, ["--save", str(tmp_path / "missing" / "ck"), "--run-dir", str(tmp_path / "r")])
    assert "its parent directory" in err and "does not exist" in err


def test_paths_the_permission_bits_call_writable_are_tried_at_start(tmp_path, capsys):
    """/proc and /sys pass os.access for root; only a test write there fails."""
    err = _train_error(capsys, ["--save", "/proc/ck", "--run-dir", str(tmp_path / "run")])
    assert err.startswith("flatfsdp train: error: --save /proc/ck: cannot save a checkpoint to /proc/ck: writing a "
                          "test directory next to it failed (No such file or directory: /proc/ck.tmp-")
    err = _train_error(capsys, ["--save", "/sys/ck", "--run-dir", str(tmp_path / "run")])
    assert "--save /sys/ck: cannot save a checkpoint to /sys/ck: writing a test directory next to it failed" in err
    err = _train_error(capsys, ["--run-dir", "/proc/runs"])
    assert "--run-dir /proc/runs cannot be created or written" in err
    assert all(p.name == "run" for p in tmp_path.iterdir())  # no probe left behind


def _ctrl_c_at(delay: float, tmp_path) -> tuple[int, list[str]]:
    """`flatfsdp train` (the installed command), SIGINT to its whole process
    group after ``delay`` seconds, as a terminal's Ctrl-C does."""
    command = os.path.join(os.path.dirname(sys.executable), "flatfsdp")
    proc = subprocess.Popen([command, "train", *TINY, "--train-iters", "100000", "--run-dir", str(tmp_path / "run")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err.strip().splitlines()


@pytest.mark.parametrize("delay", [0.3, 2.5, 5.0])
def test_ctrl_c_at_any_moment_of_start_up_prints_one_line(tmp_path, delay):
    """While Python imports torch, while the ranks import it, while they join
    the group and build the model: exit 130 and exactly one line (it used to be
    a traceback from the command and a screenful from every rank)."""
    code, lines = _ctrl_c_at(delay, tmp_path)
    assert code == 130 and len(lines) == 1, lines
    assert lines[0] in ("flatfsdp train: interrupted before training started; nothing was saved",) or \
        lines[0].startswith("flatfsdp train: interrupted at step"), lines


def test_train_save_onto_a_file_via_the_installed_command(tmp_path):
    (tmp_path / "model.bin").write_text("precious")
    done = subprocess.run([sys.executable, "-m", "flatfsdp.cli", "train", "--save", str(tmp_path / "model.bin"),
                           "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "it is a file" in done.stderr
    assert (tmp_path / "model.bin").read_text() == "precious"


# ---- a run that diverges ---------------------------------------------------------------------------

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--micro-batch-size", "2", "--eval-iters", "1", "--no-progress", "--nproc-per-node", "2"]


def _train(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flatfsdp.train", *TINY, *argv], capture_output=True, text=True,
                          timeout=300)


def test_a_diverging_run_stops_and_keeps_the_good_checkpoint(tmp_path):
    good = _train(["--train-iters", "2", "--save", str(tmp_path / "ck"), "--run-dir", str(tmp_path / "r1")])
    assert good.returncode == 0, good.stderr
    before = _snapshot(tmp_path / "ck")
    # lr 1e9 without clipping: the first step is finite, the next one is not.
    bad = _train(["--train-iters", "50", "--load", str(tmp_path / "ck"), "--save", str(tmp_path / "ck"),
                  "--save-interval", "1", "--lr", "1e9", "--clip-grad", "0", "--run-dir", str(tmp_path / "r2")])
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in bad.stderr, bad.stderr
    assert "NaN/inf" in lines[0] and "stopped before the optimizer step, nothing saved" in lines[0]
    assert lines[0].startswith("flatfsdp train: error: step ")
    log = json.loads((tmp_path / "r2" / "log.json").read_text())
    assert all(entry["loss"] == entry["loss"] for entry in log["steps"])  # no NaN recorded
    assert (tmp_path / "r2" / "loss.png").exists()
    # Every save before the NaN step held finite weights; the NaN step saved nothing.
    state = {t["name"]: t for t in ckpt.summarize(tmp_path / "ck")["tensors"]}
    assert "model.tok_emb.weight" in state
    loaded = {"model": {"tok_emb.weight": torch.zeros(state["model.tok_emb.weight"]["shape"])}}
    ckpt.load(loaded, tmp_path / "ck", strict=False)
    assert torch.isfinite(loaded["model"]["tok_emb.weight"]).all()
    if not log["steps"]:  # diverged at once: the checkpoint is byte for byte the good one
        assert _snapshot(tmp_path / "ck") == before


def test_skip_mode_skips_nonfinite_steps_and_goes_on(tmp_path):
    done = _train(["--train-iters", "6", "--lr", "1e9", "--clip-grad", "0", "--on-nonfinite", "skip",
                   "--save", str(tmp_path / "ck"), "--run-dir", str(tmp_path / "r")])
    assert done.returncode == 0, done.stderr
    log = json.loads((tmp_path / "r" / "log.json").read_text())
    events = [e for e in log.get("events", []) if "non-finite" in str(e)]
    assert events, log.get("events")
    assert all(entry["loss"] == entry["loss"] for entry in log["steps"])
    loaded = ckpt.summarize(tmp_path / "ck")  # the final save happened, with finite weights (checked on save)
    assert loaded["tensors"]
