"""How long a checkpoint save stops training: synchronous against async, in one run.

    python -m flatfsdp.bench.save_stall                      # the bench GPT (33.7M)
    python -m flatfsdp.bench.save_stall --hidden-size 768 --num-attention-heads 12   # 110M

Each round takes a synchronous save, then an async one of the same state
(with one `StagingBuffers` kept across rounds, as `flatfsdp train` does)
(model + AdamW state, sharded over the ranks) and trains on while it is
written, then trains as many steps without a save. Reported per round, as
medians over rounds (rank 0's clock; every save ends in a collective, so the
ranks end together):

* ``sync_s``: the synchronous ``checkpoint.save``;
* ``stall_s``: what the async save takes from training: the call (plan,
  copy to host memory) plus the publication in ``wait()`` (metadata,
  manifest, directory swap); ``stall_ratio``: over the same round's sync save;
* ``write_s``: from the call's return until every rank's write had ended;
* ``step_s`` / ``step_during_write_s``: a training step without and with the
  write running on the background thread.

Last, the state at the final async save is compared bit for bit with what
loading that checkpoint gives back.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import flatfsdp
from flatfsdp import checkpoint
from flatfsdp.bench.options import BenchConfig, add_model_flags
from flatfsdp.cli import flags
from flatfsdp.bench.workload import build_model, build_optimizer, device, make_batches, param_count
from flatfsdp.launch import launch
from flatfsdp.models.gpt import TransformerBlock, lm_loss


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{prefix}{i}.")
    elif isinstance(tree, torch.Tensor):
        yield prefix, (tree.to_local() if isinstance(tree, DTensor) else tree).detach().cpu().clone()


def _worker(cfg: BenchConfig, rounds: int, root: str) -> dict:
    dev = device()
    model = build_model(cfg).to(dev)
    params = param_count(model)
    model, opt = flatfsdp.fully_shard(model, build_optimizer(model.parameters(), cfg),
                                      fsdp_unit_modules=[TransformerBlock])
    batches = make_batches(cfg, dist.get_rank(), dist.get_world_size(), dev)
    count = [0]

    def step() -> float:
        started = time.perf_counter()
        x, y = batches[count[0] % len(batches)]
        count[0] += 1
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - started

    def state() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    step()  # the optimizer state exists from here on
    sync_dir, async_dir = os.path.join(root, "sync"), os.path.join(root, "async")
    rows, snapshot, staging = [], None, checkpoint.StagingBuffers()
    for _ in range(rounds):
        dist.barrier()
        started = time.perf_counter()
        checkpoint.save(state(), sync_dir)
        sync_s = time.perf_counter() - started

        dist.barrier()
        snapshot = dict(_leaves(state()))
        started = time.perf_counter()
        handle = checkpoint.save(state(), async_dir, async_save=True, staging=staging)
        returned = time.perf_counter()
        during = []
        while True:  # train on; the ranks agree each step whether every write has ended
            done = torch.tensor([1.0 if handle.done() else 0.0], device=dev)
            during.append(step())
            dist.all_reduce(done)
            if done.item() == dist.get_world_size():
                break
        written = time.perf_counter()
        handle.wait(remove_old_in_background=True)  # as flatfsdp train does
        stall_s = (returned - started) + (time.perf_counter() - written)
        plain = [step() for _ in during]
        rows.append({"sync_s": sync_s, "stall_s": stall_s, "stall_ratio": stall_s / sync_s, "call_s": returned - started,
                     "write_s": written - returned, "steps_during_write": len(during),
                     "step_s": statistics.median(plain), "step_during_write_s": statistics.median(during)})
    checkpoint.load(state(), async_dir)  # back to the state of the last async save
    loaded = dict(_leaves(state()))
    identical = loaded.keys() == snapshot.keys() and all(torch.equal(loaded[k], v) for k, v in snapshot.items())
    identical_all = [None] * dist.get_world_size()
    dist.all_gather_object(identical_all, identical)
    staged = handle.staged_bytes
    return {"parameters": params, "rounds": rows, "bit_identical": all(identical_all), "staged_bytes_rank0": staged}


def main(argv=None) -> dict:
    p = flags.CommandParser(prog="python -m flatfsdp.bench.save_stall", description=__doc__.split("\n")[0])
    add_model_flags(p, BenchConfig())
    p.add_argument("--rounds", type=int, default=5, help="rounds, each one synchronous and one async save")
    flags.add(p, "--nproc-per-node", dest="nprocs", default=2)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    a = flags.parse_or_exit(p.parse_args, argv, p.prog)
    cfg = BenchConfig(layers=a.layers, d_model=a.d_model, heads=a.heads, vocab=a.vocab, untied=a.untied,
                      batch=1, seq_len=64, steps=16, warmup=0)
    root = a.dir or tempfile.mkdtemp(prefix="flatfsdp-save-stall-")
    try:
        result = launch(_worker, a.nprocs, cfg, a.rounds, root, timeout_s=3600)
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    # The first round's async save allocates its host buffers and plans from
    # scratch; later ones reuse both (StagingBuffers), as a training run does.
    later = result["rounds"][1:] or result["rounds"]
    med = {k: statistics.median(r[k] for r in later) for k in later[0]}
    result["median"] = med
    first = result["rounds"][0]
    print(f"GPT {result['parameters'] / 1e6:.1f}M, {a.nprocs} ranks, medians of rounds 2-{a.rounds}: "
          f"sync save {med['sync_s']:.3f} s | async stall {med['stall_s']:.3f} s "
          f"({100 * med['stall_ratio']:.1f} % of the same round's sync save; call {med['call_s']:.3f} s + publish) | "
          f"first round {first['stall_s']:.3f} s vs {first['sync_s']:.3f} s | "
          f"background write {med['write_s']:.2f} s | step {med['step_s']:.3f} s, "
          f"{med['step_during_write_s']:.3f} s during the write | resume bit-identical: {result['bit_identical']}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
