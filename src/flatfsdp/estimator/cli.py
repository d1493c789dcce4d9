"""`flatfsdp estimate`: memory and traffic per rank of a model at several world
sizes, from the engine run as one rank of a fake world (docs/scale.md).

Bad input prints one line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from flatfsdp.estimator import report
from flatfsdp.estimator.deepspeed_formulas import deepspeed_model_states, model_counts
from flatfsdp.estimator.estimate import estimate
from flatfsdp.estimator.models import BUILT_IN, resolve_model
from flatfsdp.estimator.rank_step import STRATEGIES, Layout

ZERO_NUMBERS = {str(i): name for i, name in enumerate(STRATEGIES)}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flatfsdp estimate",
        description="Per-rank memory (persistent by role, transient peak, activations, peak) and bytes per step "
                    "per collective and mesh dimension, for several world sizes: the real sharded model, built "
                    "for one rank under torch's fake process group on fake tensors.")
    parser.add_argument("--model", default="gpt2-1.5b",
                        help=f"built-in ({', '.join(BUILT_IN)}), a config.json or a directory holding one, a "
                             "Hugging Face hub name, or package.module:function returning the model "
                             "(default gpt2-1.5b)")
    parser.add_argument("--units", nargs="+", help="sharding units: class names or import paths (default: the "
                                                   "model's decoder layers)")
    parser.add_argument("--world-sizes", default="8,64,256,1024", help="comma-separated (default 8,64,256,1024)")
    parser.add_argument("--strategy", default="optim_grads_params",
                        help="comma-separated: no_shard, optim, optim_grads, optim_grads_params or 0-3 "
                             "(ZeRO stages; default optim_grads_params)")
    parser.add_argument("--hsdp-shard", type=int, help="HSDP: shard each replica over this many ranks "
                                                       "(world / this many replicas)")
    parser.add_argument("--hfsdp", action="store_true", help="with --hsdp-shard: shard the optimizer state "
                                                             "across replicas too (HFSDP)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks inside each data-parallel rank "
                                                          "(the package's GPT: its MLPs; Llama-family models: "
                                                          "attention and MLP projections)")
    parser.add_argument("--bf16", action="store_true", help="compute in bf16 from fp32 main weights")
    parser.add_argument("--grad-reduce-in-bf16", action="store_true",
                        help="reduce gradients in bf16 (the whole-gradient buffers of ZeRO-0/1 halve)")
    parser.add_argument("--param-gather-dtype", choices=["int8", "fp8"],
                        help="gather weights as block-scaled 8-bit codes (docs/lowbit.md)")
    parser.add_argument("--grad-reduce-dtype", choices=["int8"],
                        help="reduce-scatter gradients as block-scaled int8 codes (docs/lowbit.md)")
    parser.add_argument("--defer-reductions", action="store_true",
                        help="sync_model_each_microbatch=False (what flatfsdp train passes): reductions may land "
                             "after backward, cross-replica ones at the optimizer step")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step (default 1)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    parser.add_argument("--recompute", choices=["none", "reentrant", "non_reentrant"], default="none",
                        help="activation recompute per unit")
    parser.add_argument("--deepspeed", action="store_true",
                        help="add DeepSpeed's model-state formula for each row (its estimate_zero*_model_states)")
    parser.add_argument("--check", action="store_true",
                        help="also run each layout for real on this machine (gloo, one process per rank) and "
                             "print predicted against measured; world sizes up to 8")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print JSON")
    out.add_argument("--markdown", action="store_true", help="print a markdown table")
    return parser


def _strategies(text: str) -> list[str]:
    names = [ZERO_NUMBERS.get(s.strip(), s.strip()) for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in STRATEGIES]
    if bad or not names:
        raise ValueError(f"--strategy {text}: expected {', '.join(STRATEGIES)} or 0-3")
    return names


def _world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--world-sizes {text}: expected comma-separated integers") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--world-sizes {text}: expected positive integers")
    return sizes


def run(args) -> int:
    if args.hfsdp and args.hsdp_shard is None:
        raise ValueError("--hfsdp needs --hsdp-shard (the ranks each replica shards over)")
    for name in ("micro_batch", "seq_len", "tp"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    spec = resolve_model(args.model, units=args.units, recompute=args.recompute)
    worlds, strategies = _world_sizes(args.world_sizes), _strategies(args.strategy)
    rows = []
    for strategy in strategies:
        rows += estimate(spec, worlds, strategy=strategy, shard_size=args.hsdp_shard, outer_sharding=args.hfsdp,
                         tp=args.tp, bf16=args.bf16, reduce_bf16=args.grad_reduce_in_bf16,
                         defer_reductions=args.defer_reductions, param_gather_dtype=args.param_gather_dtype,
                         grad_reduce_dtype=args.grad_reduce_dtype,
                         micro_batch=args.micro_batch, seq_len=args.seq_len)
    deepspeed = _deepspeed(spec, rows) if args.deepspeed else None
    if args.json:
        print(json.dumps(report.as_json(args.model, rows, deepspeed), indent=2))
    else:
        header, cells, unit = report.table_cells(rows, deepspeed)
        table = report.markdown_table(header, cells) if args.markdown else report.text_table(header, cells)
        print(_title(args, rows[0][1].params))
        print(table)
        print(f"{unit} per rank; traffic in {unit} per step per rank (AG all-gather, RS reduce-scatter, AR "
              "all-reduce, over the mesh dimension named; 'world' spans every rank)")
    if args.check:
        return _check(args.model, [layout for layout, _ in rows])
    return 0


def _title(args, params: int) -> str:
    grads = args.grad_reduce_dtype or ("bf16" if args.grad_reduce_in_bf16 else "fp32")
    precision = (f"bf16 compute, fp32 main weights, {grads} gradient reduction" if args.bf16
                 else f"fp32, {grads} gradient reduction")
    if args.param_gather_dtype:
        precision += f", {args.param_gather_dtype} weight gathers"
    return (f"{args.model}: {params / 1e9:.3g} B parameters, {precision}, AdamW, micro-batch {args.micro_batch} x "
            f"{args.seq_len} tokens, recompute {args.recompute}")


def _deepspeed(spec, rows: list) -> list[int | None]:
    params, largest = model_counts(spec.build())
    stage = {name: i for i, name in enumerate(STRATEGIES)}
    # Tensor parallelism is not one of DeepSpeed's estimator's cases.
    return [None if layout.tp > 1 else deepspeed_model_states(stage[layout.strategy], params, largest, layout.shard)
            for layout, _ in rows]


def _check(model: str, layouts: list[Layout]) -> int:
    from flatfsdp.estimator.verify import compare

    if max(layout.world for layout in layouts) > 8:
        raise ValueError("--check runs every rank on this machine: keep --world-sizes at 8 or below")
    print("\nchecked on this machine (rank 0; MiB):")
    print("world  layout                 persistent predicted/measured   peak predicted/measured   peak error")
    worst = 0.0
    for c in compare(model, layouts):
        same = "equal" if c.predicted.persistent == c.measured.persistent else "DIFFER"
        print(f"{c.layout.world:<6} {c.layout.describe():<22} {sum(c.predicted.persistent.values()) / 2**20:10.2f} / "
              f"{sum(c.measured.persistent.values()) / 2**20:<10.2f} {same:<6} {c.predicted.peak / 2**20:10.2f} / "
              f"{c.measured.peak / 2**20:<10.2f} {c.peak_error * 100:+6.1f}%")
        worst = max(worst, abs(c.peak_error))
    print(f"largest peak error {worst * 100:.1f}%")
    return 0


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        code = run(args)
    except ValueError as exc:
        print(f"flatfsdp estimate: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(code)
