"""Async checkpoint saves (flatfsdp.checkpoint.save(..., async_save=True)) on 2
real gloo ranks: the write runs while the main thread changes the tensors and
runs collectives of its own; what is published is what was passed, with the
same refusals and manifest as a synchronous save; errors surface at wait() on
every rank; a real SIGKILL during the background write leaves the previous
checkpoint loadable. `flatfsdp train --async-save` is covered by
test_train_resume.py (bitwise resume) and test_train_cli.py (Ctrl-C)."""

from __future__ import annotations

import errno
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from flatfsdp import checkpoint as ckpt
from flatfsdp.checkpoint import save_job
from harness import _free_port, run_ranks


def _values(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"big": torch.randn(64, 32), "odd": torch.randn(5, 3), "bias": torch.randn(7)}


def _sharded(seed: int, mesh) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    placements = {"big": [Shard(0)], "odd": [Shard(0)], "bias": [Replicate()]}
    model = {k: distribute_tensor(v, mesh, placements[k]) for k, v in _values(seed).items()}
    return {"model": model, "step": seed, "note": f"seed {seed}"}


def _loaded(target, mesh) -> dict:
    state = _sharded(99, mesh)
    ckpt.load(state, target)
    return {"model": {k: v.full_tensor() for k, v in state["model"].items()}, "step": state["step"],
            "note": state["note"]}


def _same(loaded: dict, seed: int) -> bool:
    return (loaded["step"] == seed and loaded["note"] == f"seed {seed}"
            and all(torch.equal(loaded["model"][k], v) for k, v in _values(seed).items()))


class _GatedWriter(dcp.FileSystemWriter):
    """Holds the background write until the file ``gate`` exists."""

    gate = ""

    def write_data(self, plan, planner):
        while not os.path.exists(self.gate):
            time.sleep(0.01)
        return super().write_data(plan, planner)


class _FullDiskWriter(dcp.FileSystemWriter):
    def write_data(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError(errno.ENOSPC, "No space left on device", self.path)
        return super().write_data(plan, planner)


def _async_worker(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    target, gate = os.path.join(root, "ck"), os.path.join(root, "gate")
    ckpt.save(_sharded(0, mesh), target)
    _GatedWriter.gate = gate
    save_job._writer = _GatedWriter  # this spawned process only
    out = {}

    state = _sharded(1, mesh)
    buffers = ckpt.StagingBuffers()  # kept across saves: host memory and the save plan are reused
    handle = ckpt.save(state, target, async_save=True, staging=buffers)
    out["staged_bytes"] = handle.staged_bytes
    out["done_while_gated"] = handle.done()
    # "Training" goes on: the values change in place and the main thread runs
    # collectives (a load is several) while the write is held.
    for v in state["model"].values():
        v.to_local().add_(100.0)
    state["step"] = 1000
    total = torch.ones(1)
    dist.all_reduce(total)
    out["all_reduce"] = total.item()
    out["old_while_in_flight"] = _same(_loaded(target, mesh), 0)
    if rank == 0:
        open(gate, "w").close()
    handle.wait()
    out["new_after_wait"] = _same(_loaded(target, mesh), 1)

    # A save started while one is in flight waits for it (publishes it) first.
    handle = ckpt.save(_sharded(2, mesh), target, async_save=True, staging=buffers)
    out["buffers_kept"] = buffers.nbytes == out["staged_bytes"]
    ckpt.save(_sharded(3, mesh), os.path.join(root, "other"))
    out["published_by_next_save"] = handle.done() and _same(_loaded(target, mesh), 2)
    handle.wait()  # already published: returns at once

    # A background write that fails on rank 1 fails wait() on every rank, naming it.
    save_job._writer = _FullDiskWriter
    handle = ckpt.save(_sharded(4, mesh), target, async_save=True)
    try:
        handle.wait()
        out["error"] = None
    except ckpt.CheckpointError as exc:
        out["error"] = str(exc)
    out["kept_after_error"] = _same(_loaded(target, mesh), 2)

    # The refusals run before async_save returns: a user's file is never touched.
    save_job._writer = dcp.FileSystemWriter
    user_file = os.path.join(root, "notes.txt")
    try:
        ckpt.save(_sharded(5, mesh), user_file, async_save=True)
        out["refused"] = None
    except ckpt.CheckpointError as exc:
        out["refused"] = str(exc)
    return out


def test_async_save_publishes_what_was_passed_while_training_goes_on(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    results = run_ranks(_async_worker, 2, str(tmp_path), timeout=180)
    for rank, out in enumerate(results):
        assert out["done_while_gated"] is False and out["all_reduce"] == 2.0
        assert out["old_while_in_flight"] and out["new_after_wait"], out
        assert out["published_by_next_save"] and out["buffers_kept"], out
        assert out["error"] is not None and out["error"].startswith("rank 1 could not write its part of"), out
        assert "No space left on device" in out["error"] and "keeps what it held" in out["error"]
        assert out["kept_after_error"]
        assert out["refused"] and "it is a file" in out["refused"]
    # Each rank staged its own shards only; the replicated 'bias' is written (and
    # staged) by one rank: DCP's deduplication gives it to the one with fewer bytes.
    assert [r["staged_bytes"] for r in results] == [(32 * 32 + 3 * 3) * 4, (32 * 32 + 2 * 3 + 7) * 4]
    assert (tmp_path / "notes.txt").read_text() == "mine"
    manifest = ckpt.summarize(tmp_path / "ck", verify_data=True)  # every file matches the manifest
    assert {t["name"] for t in manifest["tensors"]} == {"model.big", "model.odd", "model.bias"}


# ---- kill -9 while the background thread writes -------------------------------------------------------


class _StuckWriter(dcp.FileSystemWriter):
    """Writes this rank's files, says so, then never finishes: the process is
    killed in the middle of its background write."""

    marker = ""

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        open(f"{self.marker}-{dist.get_rank()}", "w").close()
        time.sleep(600)
        return future


def _killed_entry(rank: int, port: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2,))
    target = os.path.join(root, "ck")
    ckpt.save(_sharded(0, mesh), target)
    _StuckWriter.marker = os.path.join(root, "writing")
    save_job._writer = _StuckWriter
    ckpt.save(_sharded(1, mesh), target, async_save=True)
    step = torch.zeros(1)
    while True:  # training goes on until the kill
        dist.all_reduce(step)
        time.sleep(0.01)


def test_kill_9_during_the_background_write_keeps_the_previous_checkpoint(tmp_path):
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_killed_entry, args=(r, port, str(tmp_path)), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"writing-{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline and all(p.is_alive() for p in procs), "the ranks never wrote"
            time.sleep(0.05)
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.join(timeout=30)
        assert [p.exitcode for p in procs] == [-signal.SIGKILL] * 2
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    # Both ranks' data files were complete on disk, yet nothing was published.
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith("ck.tmp-")]
    assert len(leftovers) == 1 and {"__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(leftovers[0]))
    with pytest.raises(ckpt.CheckpointError, match="is not a complete flatfsdp checkpoint"):
        ckpt.summarize(leftovers[0])
    expected = _values(0)
    loaded = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}, "step": -1, "note": ""}
    ckpt.load(loaded, tmp_path / "ck")
    assert loaded["step"] == 0 and all(torch.equal(loaded["model"][k], v) for k, v in expected.items())
