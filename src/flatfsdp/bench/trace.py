"""`python -m flatfsdp.bench.trace`: a profiler trace of flatfsdp's schedule.

Trains the benchmark GPT under flatfsdp for a few steps, profiles the last
one with ``torch.profiler`` on every rank, writes one Chrome trace per rank
(open in chrome://tracing or https://ui.perfetto.dev) and prints rank 0's
phases in order: where each gather and reduction was issued, and how long the
host then waited for one (``wait_unshard``, ``wait_reductions``) -- the
communication the schedule did not hide behind compute.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from flatfsdp.bench.options import PRESETS, BenchConfig, add_model_flags, add_tied_unit_flag
from flatfsdp.bench.workload import (build_model, build_optimizer, device, make_batches, schedule_embedding_units,
                                     unit_classes)
from flatfsdp.cli import flags

WAITS = ("flatfsdp::wait_unshard", "flatfsdp::wait_reductions")


def _step(model, optimizer, x, y) -> None:
    model(x, targets=y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def trace_rank(cfg: BenchConfig, out: str, warmup: int) -> dict:
    import flatfsdp

    torch.set_num_threads(cfg.threads_per_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(cfg).to(device())
    optimizer = build_optimizer(model.parameters(), cfg)
    model, optimizer = flatfsdp.fully_shard(model, optimizer, fsdp_unit_modules=unit_classes(model, cfg.tied_unit),
                                            zero_dp_strategy=cfg.strategy)
    schedule_embedding_units(model, rows_only=cfg.strategy == "optim_grads_params")
    batches = make_batches(cfg, rank, world, device())
    for x, y in batches[:warmup]:
        _step(model, optimizer, x, y)
    dist.barrier()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device().type == "cuda" else [])
    with profile(activities=activities) as prof:
        _step(model, optimizer, *batches[warmup])
    path = Path(out) / f"trace_rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return _phases(prof, str(path))


def _phases(prof, path: str) -> dict:
    """The flatfsdp:: ranges of the profiled step in start order, in ms from its start."""
    events = [e for e in prof.events() if e.name.startswith("flatfsdp::") or e.name.startswith("Optimizer.step")]
    everything = list(prof.events())
    start = min(e.time_range.start for e in everything)
    end = max(e.time_range.end for e in everything)
    rows = sorted(((e.time_range.start - start) / 1e3, e.cpu_time_total / 1e3, e.name) for e in events)
    waited = sum(ms for _, ms, name in rows if name.split(" (")[0] in WAITS)
    return dict(trace=path, step_ms=(end - start) / 1e3, waited_ms=waited, rows=rows)


def main(argv: list[str] | None = None) -> dict:
    parser = flags.CommandParser(prog="python -m flatfsdp.bench.trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small-batch", help="micro batch x tokens")
    add_model_flags(parser, BenchConfig())
    add_tied_unit_flag(parser)
    flags.add(parser, "--max-position-embeddings", dest="context", default=BenchConfig.context)
    flags.add(parser, "--nproc-per-node", dest="nprocs", default=2)
    flags.add(parser, "--data-parallel-sharding-strategy", dest="strategy", type=flags.parse_strategy,
              default="optim_grads_params")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before the profiled one")
    parser.add_argument("--out", default="flatfsdp-trace", help="directory for trace_rank*.json")
    args = flags.parse_or_exit(parser.parse_args, argv, parser.prog)
    shape = dict(PRESETS[args.preset])
    shape["seq_len"] = min(shape["seq_len"], args.context)
    cfg = BenchConfig(layers=args.layers, d_model=args.d_model, heads=args.heads, vocab=args.vocab,
                      untied=args.untied, tied_unit=args.tied_unit, context=args.context, nprocs=args.nprocs,
                      strategy=args.strategy, steps=1,
                      warmup=args.warmup, preset=args.preset, **shape)
    from flatfsdp.launch import launch
    result = launch(trace_rank, cfg.nprocs, cfg, args.out, args.warmup)
    print(f"rank 0, one {args.preset} step of {result['step_ms']:.0f} ms; host blocked on communication "
          f"{result['waited_ms']:.0f} ms ({result['waited_ms'] / result['step_ms']:.0%})")
    print("   start ms  took ms  phase")
    for at, took, name in result["rows"]:
        print(f"  {at:9.1f} {took:8.1f}  {name}")
    print(f"traces: {Path(args.out).resolve()}/trace_rank*.json")
    return result


if __name__ == "__main__":
    main()
