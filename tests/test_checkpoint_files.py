"""Checkpoint files (flatfsdp.checkpoint): atomic save, verified load, the
safety of loading, and the inspect/export/import tools -- independent of the
sharding engine (DTensors come from distribute_tensor)."""

from __future__ import annotations

import json
import os
import pickle
import queue
import signal
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from flatfsdp import checkpoint as ckpt
from flatfsdp.checkpoint import atomic, export, manifest, save_job
from flatfsdp.checkpoint.cli import main as cli
from flatfsdp.checkpoint.errors import CheckpointError
from flatfsdp.models.gpt import GPT, GPTConfig
from harness import _free_port, run_ranks

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
OTHER_CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=16)


def gpt_state(seed: int = 0, cfg: GPTConfig = CFG) -> dict:
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in GPT(cfg).state_dict().items()}


def zeros_like_tree(tree):
    return {k: zeros_like_tree(v) if isinstance(v, dict) else
            torch.zeros_like(v) if isinstance(v, torch.Tensor) else type(v)() for k, v in tree.items()}


def assert_tree_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_tree_equal(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def training_state(seed: int = 0) -> dict:
    return {"model": gpt_state(seed), "step": 7 + seed, "extra": {"note": f"seed {seed}", "lrs": [0.1, 0.01]}}


def data_file(directory) -> str:
    return os.path.join(directory, "__0_0.distcp")


# ---- save / load -------------------------------------------------------------------------------


def test_save_replaces_previous_checkpoint_and_loads_back(tmp_path):
    target = tmp_path / "ck"
    ckpt.save(training_state(0), target)
    ckpt.save(training_state(1), target)
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no tmp or aside directories left
    files = json.loads((target / ckpt.MANIFEST_NAME).read_text())["files"]
    assert set(files) == {".metadata", "__0_0.distcp"}
    loaded = zeros_like_tree(training_state(0))
    ckpt.load(loaded, target)
    assert_tree_equal(loaded, training_state(1))


def test_replace_without_atomic_exchange(tmp_path, monkeypatch):
    """The two-rename fallback (no RENAME_EXCHANGE) also leaves exactly the new checkpoint."""
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    ckpt.save(training_state(0), tmp_path / "ck")
    ckpt.save(training_state(1), tmp_path / "ck")
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    loaded = zeros_like_tree(training_state(0))
    ckpt.load(loaded, tmp_path / "ck")
    assert_tree_equal(loaded, training_state(1))


@pytest.mark.parametrize("new_complete", [True, False])
def test_interrupted_fallback_swap_is_recovered(tmp_path, new_complete):
    """A crash between the fallback's two renames leaves no DIR; load puts back the new
    checkpoint when it is complete, else the old one."""
    target, new = tmp_path / "ck", tmp_path / "new"
    ckpt.save(training_state(0), target)
    ckpt.save(training_state(1), new)
    if not new_complete:
        os.remove(new / ckpt.MANIFEST_NAME)
    os.rename(target, f"{target}.old-abcdef012345")
    os.rename(new, f"{target}.tmp-abcdef012345")
    loaded = zeros_like_tree(training_state(0))
    ckpt.load(loaded, target)
    assert_tree_equal(loaded, training_state(1 if new_complete else 0))


def test_truncated_file_is_named(tmp_path):
    ckpt.save(training_state(), tmp_path / "ck")
    path = data_file(tmp_path / "ck")
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: truncated or corrupted"):
        ckpt.load(zeros_like_tree(training_state()), tmp_path / "ck")


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata"])
def test_flipped_byte_is_named(tmp_path, name):
    ckpt.save(training_state(), tmp_path / "ck")
    path = tmp_path / "ck" / name
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"{name}: truncated or corrupted"):
        ckpt.load(zeros_like_tree(training_state()), tmp_path / "ck")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_directory_without_manifest_is_refused(tmp_path):
    dcp.save(training_state(), checkpoint_id=str(tmp_path / "plain"))  # a DCP checkpoint, but not ours
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'plain'} is not a complete flatfsdp checkpoint"):
        ckpt.load(zeros_like_tree(training_state()), tmp_path / "plain")
    with pytest.raises(CheckpointError, match="does not exist"):
        ckpt.load(zeros_like_tree(training_state()), tmp_path / "nowhere")


def test_other_models_checkpoint_lists_every_difference(tmp_path):
    ckpt.save({"model": gpt_state(cfg=OTHER_CFG)}, tmp_path / "other")
    with pytest.raises(CheckpointError) as info:
        ckpt.load({"model": gpt_state()}, tmp_path / "other")
    message = str(info.value)
    assert "does not match the state dict being loaded" in message
    assert "12 missing keys (requested, not in the checkpoint):\n    model.blocks.1.attn.proj.bias" in message
    assert "17 mismatched entries" in message
    assert "model.blocks.0.attn.proj.weight: shape (16, 16) in checkpoint vs (32, 32) requested" in message
    assert "\n    ... and 7 more" in message  # long lists are cut at 10 with a count
    # Keys the checkpoint has that the caller lacks, under a root the caller asked for.
    extra = {"model": {**gpt_state(cfg=OTHER_CFG), "head.bias": torch.zeros(64)}}
    ckpt.save(extra, tmp_path / "extra")
    with pytest.raises(CheckpointError, match=r"1 unexpected keys .*\n    model.head.bias"):
        ckpt.load({"model": gpt_state(cfg=OTHER_CFG)}, tmp_path / "extra")
    with pytest.raises(CheckpointError, match="dtype torch.float32 in checkpoint vs torch.float16"):
        ckpt.load({"model": {k: v.half() for k, v in gpt_state(cfg=OTHER_CFG).items()}}, tmp_path / "other")


def test_subsets_load_without_complaint(tmp_path):
    """Only the model from a model+extras checkpoint; strict=False tolerates missing keys."""
    ckpt.save(training_state(3), tmp_path / "ck")
    model_only = {"model": zeros_like_tree(gpt_state())}
    ckpt.load(model_only, tmp_path / "ck")
    assert_tree_equal(model_only["model"], gpt_state(3))
    partial = {"model": {"tok_emb.weight": torch.zeros(64, 32), "new.weight": torch.ones(2)}}
    ckpt.load(partial, tmp_path / "ck", strict=False)
    assert torch.equal(partial["model"]["tok_emb.weight"], gpt_state(3)["tok_emb.weight"])
    assert torch.equal(partial["model"]["new.weight"], torch.ones(2))


class _Payload:
    """Unpickling this would run code; a checkpoint must never be able to do that."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_metadata_pickle_cannot_run_code(tmp_path):
    """Even with a manifest rewritten to match, a crafted .metadata is refused, not executed."""
    target, marker = tmp_path / "ck", tmp_path / "pwned"
    ckpt.save(training_state(), target)
    (target / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    manifest.write_manifest(str(target))
    with pytest.raises(CheckpointError, match="posix.mkdir is not allowed in checkpoint metadata"):
        ckpt.load(zeros_like_tree(training_state()), target)
    with pytest.raises(SystemExit):
        cli(["inspect", str(target)])
    assert not marker.exists()


def test_non_tensor_entries_load_weights_only(tmp_path):
    marker = tmp_path / "pwned"
    ckpt.save({"model": gpt_state(), "hook": _Payload(str(marker))}, tmp_path / "ck")
    with pytest.raises(CheckpointError, match="'hook' is not a plain value.*GLOBAL posix.mkdir"):
        ckpt.load({"model": gpt_state(), "hook": None}, tmp_path / "ck")
    assert not marker.exists()


# ---- a rank dies in the middle of a save -----------------------------------------------------


class _DyingWriter(dcp.FileSystemWriter):
    """Rank 1 writes its shard, cuts its file in half, then is SIGKILLed before
    the save completes -- what a crash or OOM-kill in the middle of writing looks like."""

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        if dist.get_rank() == 1:
            for name in os.listdir(self.path):
                if name.startswith("__1_"):
                    path = os.path.join(self.path, name)
                    os.truncate(path, os.path.getsize(path) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        return future


def _full_values(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"big": torch.randn(512, 1024), "odd": torch.randn(5, 3), "bias": torch.randn(7)}


def _sharded_state(seed: int, mesh) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    placements = {"big": [Shard(0)], "odd": [Shard(0)], "bias": [Replicate()]}
    return {"model": {k: distribute_tensor(v, mesh, placements[k]) for k, v in _full_values(seed).items()}}


def _dying_save_entry(rank: int, port: int, target: str, results) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=15))
    mesh = init_device_mesh("cpu", (2,))
    ckpt.save(_sharded_state(0, mesh), target)
    save_job._writer = _DyingWriter  # only for this spawned process
    try:
        ckpt.save(_sharded_state(1, mesh), target)
        results.put((rank, "returned"))
    except BaseException as exc:  # the survivor must fail, not hang (DCP raises a BaseException)
        results.put((rank, f"raised {type(exc).__name__}"))


def test_rank_killed_mid_save_keeps_previous_checkpoint(tmp_path):
    target = str(tmp_path / "ck")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_dying_save_entry, args=(r, port, target, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        rank, outcome = results.get(timeout=120)
        assert (rank, outcome.split()[0]) == (0, "raised"), outcome
        procs[1].join(timeout=30)
        assert procs[1].exitcode == -signal.SIGKILL
    except queue.Empty:
        pytest.fail("the surviving rank hung in save")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    # The previous checkpoint is intact and holds the first save's values.
    expected = _full_values(0)
    loaded = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}}
    ckpt.load(loaded, target)
    assert_tree_equal(loaded["model"], expected)
    # The interrupted save left only a manifest-less directory that nothing accepts.
    siblings = sorted(os.listdir(tmp_path))
    complete = [s for s in siblings if os.path.exists(tmp_path / s / ckpt.MANIFEST_NAME)]
    assert complete == ["ck"]
    leftovers = [s for s in siblings if s.startswith("ck.tmp-")]
    assert len(leftovers) == 1 and "__1_0.distcp" in os.listdir(tmp_path / leftovers[0])  # died mid-write
    with pytest.raises(CheckpointError, match="is not a complete flatfsdp checkpoint"):
        ckpt.load(loaded, tmp_path / leftovers[0])
    ckpt.save({"model": expected}, target)  # the next save clears the debris
    assert sorted(os.listdir(tmp_path)) == ["ck"]


# ---- two ranks: sharded save, resharded load, consolidated export --------------------------------


def _two_rank_full() -> dict:
    full = gpt_state(5)
    full["odd.weight"] = torch.arange(15.0).reshape(5, 3)  # shards unevenly over 2 ranks
    return full


def _two_rank_worker(rank: int, world: int, target: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    full = _two_rank_full()
    # DTensors with global shapes, sharded along alternating dims: the form the
    # engine's model.state_dict() hands to DCP.
    sharded = {k: distribute_tensor(v, mesh, [Shard(i % v.dim())]) for i, (k, v) in enumerate(full.items())}
    ckpt.save({"model": sharded, "step": 3}, target)
    ckpt.save({"model": sharded, "step": 4}, target)  # replacing under a process group
    target_state = {"model": {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)])
                              for k, v in full.items()}, "step": 0}
    ckpt.load(target_state, target)
    resharded = {k: v.full_tensor() for k, v in target_state["model"].items()}
    errors = []
    try:
        ckpt.load({"model": {"tok_emb.weight": distribute_tensor(torch.zeros(3, 3), mesh, [Shard(0)])}}, target)
    except CheckpointError as exc:
        errors.append(str(exc))
    if rank == 0:  # the tools work on one rank of a distributed job without collectives
        ckpt.export_checkpoint(target, f"{target}-rank0.safetensors")
        ckpt.import_state_dict(f"{target}-rank0.safetensors", f"{target}-imported")
    dist.barrier()
    return {"resharded": resharded, "step": target_state["step"], "errors": errors}


def test_two_rank_checkpoint_reshards_and_exports_full_values(tmp_path):
    target = str(tmp_path / "ck")
    results = run_ranks(_two_rank_worker, 2, target, timeout=180)
    expected = _two_rank_full()
    for result in results:
        assert_tree_equal(result["resharded"], expected)
        assert result["step"] == 4
        assert len(result["errors"]) == 1 and "shape (64, 32) in checkpoint vs (3, 3)" in result["errors"][0]
    assert sorted(os.listdir(tmp_path)) == ["ck", "ck-imported", "ck-rank0.safetensors"]
    files = json.loads((tmp_path / "ck" / ckpt.MANIFEST_NAME).read_text())["files"]
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(files)
    from safetensors.torch import load_file
    assert cli(["export", target, str(tmp_path / "full.safetensors")]) is None
    assert_tree_equal(load_file(str(tmp_path / "full.safetensors")), expected)
    assert_tree_equal(load_file(str(tmp_path / "ck-rank0.safetensors")), expected)
    reloaded = {"model": zeros_like_tree(expected)}
    ckpt.load(reloaded, tmp_path / "ck-imported")
    assert_tree_equal(reloaded["model"], expected)


# ---- the command-line tools ------------------------------------------------------------------


def test_inspect_table_and_json(tmp_path, capsys):
    ckpt.save(training_state(), tmp_path / "ck")
    cli(["inspect", str(tmp_path / "ck")])
    table = capsys.readouterr().out
    assert "model.tok_emb.weight" in table and "(64, 32)" in table and "float32" in table and "8,192" in table
    assert "step" in table and "object" in table
    state = gpt_state()
    total = sum(v.numel() * v.element_size() for v in state.values())
    assert f"total: {len(state)} tensors, {total:,} bytes" in table
    cli(["inspect", str(tmp_path / "ck"), "--json", "--verify"])
    summary = json.loads(capsys.readouterr().out)
    by_name = {t["name"]: t for t in summary["tensors"]}
    assert by_name["model.tok_emb.weight"] == {"name": "model.tok_emb.weight", "shape": [64, 32],
                                               "dtype": "float32", "bytes": 8192}
    assert {o["name"] for o in summary["objects"]} == {"step", "extra.note", "extra.lrs"}
    assert summary["total_tensor_bytes"] == total


def test_export_streams_model_tensors(tmp_path, capsys, monkeypatch):
    from safetensors.torch import load_file
    ckpt.save(training_state(), tmp_path / "ck")
    batches = []
    real = export._load_batch
    monkeypatch.setattr(export, "_load_batch", lambda reader, batch: batches.append(len(batch)) or real(reader, batch))
    out = tmp_path / "model.safetensors"
    cli(["export", str(tmp_path / "ck"), str(out), "--budget-mib", "0"])
    assert "wrote" in capsys.readouterr().out
    assert batches and max(batches) == 1  # a zero budget loads one tensor at a time
    assert_tree_equal(load_file(str(out)), gpt_state())  # names have "model." stripped
    assert not os.path.exists(f"{out}.partial")


def test_export_pt_and_all(tmp_path):
    ckpt.save(training_state(), tmp_path / "ck")
    cli(["export", str(tmp_path / "ck"), str(tmp_path / "all.pt"), "--all"])
    everything = torch.load(tmp_path / "all.pt", weights_only=True)
    expected = {f"model.{k}": v for k, v in gpt_state().items()}
    expected.update({"step": 7, "extra.note": "seed 0", "extra.lrs": [0.1, 0.01]})
    assert_tree_equal(everything, expected)
    cli(["export", str(tmp_path / "ck"), str(tmp_path / "model.pt")])
    assert_tree_equal(torch.load(tmp_path / "model.pt", weights_only=True), gpt_state())


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_import_then_load_into_a_model(tmp_path, suffix, capsys):
    source = tmp_path / f"weights{suffix}"
    if suffix == ".pt":
        torch.save(gpt_state(2), source)
    else:
        from safetensors.torch import save_file
        save_file(gpt_state(2), str(source))
    cli(["import", str(source), str(tmp_path / "ck")])
    assert "wrote a checkpoint" in capsys.readouterr().out
    model = GPT(CFG)
    state = {"model": model.state_dict()}
    ckpt.load(state, tmp_path / "ck")
    assert_tree_equal({k: v for k, v in model.state_dict().items()}, gpt_state(2))


def test_import_refuses_pickled_code(tmp_path, capsys):
    marker = tmp_path / "pwned"
    torch.save({"w": _Payload(str(marker))}, tmp_path / "evil.pt")
    err = _cli_error(["import", str(tmp_path / "evil.pt"), str(tmp_path / "ck")], capsys)
    assert "refusing to unpickle" in err and "GLOBAL posix.mkdir" in err and not marker.exists()
    assert not (tmp_path / "ck").exists()


def _cli_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        cli(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert "does not exist" in _cli_error(["inspect", str(tmp_path / "nowhere")], capsys)
    (tmp_path / "empty").mkdir()
    assert "not a complete flatfsdp checkpoint" in _cli_error(["export", str(tmp_path / "empty"),
                                                                str(tmp_path / "o.safetensors")], capsys)
    ckpt.save(training_state(), tmp_path / "ck")
    path = data_file(tmp_path / "ck")
    os.truncate(path, 100)
    err = _cli_error(["export", str(tmp_path / "ck"), str(tmp_path / "o.safetensors")], capsys)
    assert "__0_0.distcp: truncated or corrupted" in err and not (tmp_path / "o.safetensors").exists()
    assert "truncated or corrupted" in _cli_error(["inspect", str(tmp_path / "ck")], capsys)


def test_cli_module_entry_point(tmp_path):
    run = subprocess.run([sys.executable, "-m", "flatfsdp.checkpoint.cli", "inspect", str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().endswith("the directory does not exist")


def test_own_safetensors_reader_matches_the_reference_and_names_bad_files(tmp_path):
    from safetensors.torch import save_file

    from flatfsdp.checkpoint.safetensors_format import read_safetensors
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(4).bfloat16(),
               "d": torch.ones(2, 3, dtype=torch.bool), "empty": torch.zeros(0, 4)}
    path = tmp_path / "ref.safetensors"
    save_file(tensors, str(path))
    assert_tree_equal(read_safetensors(str(path)), tensors)
    os.truncate(path, os.path.getsize(path) - 3)
    with pytest.raises(CheckpointError, match="ref.safetensors: truncated or corrupted"):
        read_safetensors(str(path))
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="junk.safetensors: truncated or corrupted"):
        read_safetensors(str(tmp_path / "junk.safetensors"))
