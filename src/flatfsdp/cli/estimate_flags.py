"""`flatfsdp estimate`'s flags and the checks that need no model: parsed
before torch is imported (flatfsdp.estimator.cli runs the estimate)."""

from __future__ import annotations

import argparse

from flatfsdp.cli import flags
from flatfsdp.cli.flags import UsageError

PROG = "flatfsdp estimate"
DEVICE_NAMES = ("a100", "h100", "h200")
"""flatfsdp.estimator.devices.DEVICES, named here without importing torch (a test holds them equal)."""
BUILT_IN_MODELS = ("gpt-tiny", "gpt2-1.5b", "gpt2-124m", "gpt2-350m", "gpt2-774m", "llama-3-70b", "llama-3-8b")
"""flatfsdp.estimator.models.BUILT_IN, named here without importing torch (a test holds them equal)."""


def _strategies(text: str) -> list[str]:
    names = [flags.parse_strategy(s) for s in text.split(",") if s.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected one or more of {', '.join(flags.STRATEGIES)} or 0-3")
    return names


def _world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: expected comma-separated integers") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text}: expected positive integers")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = flags.CommandParser(
        prog=PROG,
        description="Per-rank memory (persistent by role, transient peak, activations, peak) and bytes per step "
                    "per collective and mesh dimension, for several world sizes: the real sharded model, built "
                    "for one rank under torch's fake process group on fake tensors. See docs/scale.md.")
    parser.add_argument("--model", default="gpt2-1.5b",
                        help=f"built-in ({', '.join(BUILT_IN_MODELS)}), a config.json or a directory holding one, a "
                             "Hugging Face hub name, or package.module:function returning the model")
    parser.add_argument("--units", nargs="+", metavar="CLASS",
                        help="sharding units: class names or import paths (default: the model's decoder layers)")
    parser.add_argument("--world-sizes", type=_world_sizes, default="8,64,256,1024", metavar="N,N,...",
                        help="world sizes to estimate, comma-separated")
    flags.add(parser, "--data-parallel-sharding-strategy", type=_strategies, default="optim_grads_params",
              note="several, comma-separated, are estimated side by side")
    parser.add_argument("--hsdp-shard", type=int, metavar="N",
                        help="HSDP: shard each replica over this many ranks, world / this many replicas "
                             "(default: no HSDP, one replica over every rank)")
    parser.add_argument("--hfsdp", action="store_true", help="with --hsdp-shard: shard the optimizer state "
                                                             "across replicas too (HFSDP)")
    flags.add(parser, "--tensor-model-parallel-size", default=1,
              note="the package's GPT: its MLPs; Llama-family models: attention and MLP projections")
    flags.add(parser, "--bf16")
    flags.add(parser, "--grad-reduce-in-bf16", note="the whole-gradient buffers of ZeRO-0/1 halve")
    flags.add(parser, "--param-gather-dtype", default_text="the compute dtype")
    flags.add(parser, "--grad-reduce-dtype", default_text="fp32, or bf16 with --grad-reduce-in-bf16")
    parser.add_argument("--defer-reductions", action="store_true",
                        help="sync_model_each_microbatch=False (what flatfsdp train passes): reductions may land "
                             "after backward, cross-replica ones at the optimizer step")
    flags.add(parser, "--micro-batch-size", default=1)
    flags.add(parser, "--seq-length", default=1024)
    flags.add(parser, "--recompute", default="none")
    parser.add_argument("--deepspeed", action="store_true",
                        help="add DeepSpeed's model-state formula for each row (its estimate_zero*_model_states)")
    parser.add_argument("--check", action="store_true",
                        help="also run each layout for real on this machine (gloo, one process per rank) and "
                             "print predicted against measured; world sizes up to 8")
    time = parser.add_argument_group("time (docs/scale.md, 'Time on paper')")
    flags.add(time, "--predict", note="for each row: its step time, the communication it leaves exposed per "
              "link and TFLOP/s per rank, and the layout to pick at each world size (the fastest that fits "
              "--memory-gib)")
    time.add_argument("--device", default="h100", choices=DEVICE_NAMES,
                      help="compute from this device's published throughput (default: h100)")
    time.add_argument("--probe", action="store_true",
                      help="compute from a probe of this machine instead (the model's unsharded step timed op by "
                           "op; the model must run here): on a CPU host, its ranks side by side on loopback (gloo); "
                           "on an accelerator, every rank such a device, joined by --intra-link/--inter-link")
    time.add_argument("--ranks-per-node", type=int, default=8, metavar="N", help="ranks a node holds (default: 8)")
    time.add_argument("--intra-link", default="nvlink-h100", metavar="LINK",
                      help="the link inside a node: a preset (nvlink-h100, ib-400, ib-200, eth-100) or a rate in "
                           "tc's units (900gbit) (default: nvlink-h100)")
    time.add_argument("--inter-link", default="ib-400", metavar="LINK",
                      help="each rank's link between nodes, likewise (default: ib-400; the bench's --link 2gbit works)")
    time.add_argument("--memory-gib", type=float, default=80.0, metavar="GIB",
                      help="memory a rank has: the pick must fit its peak (default: 80)")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print JSON (default: a text table)")
    out.add_argument("--markdown", action="store_true", help="print a markdown table")
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line, checked as far as it can be without the model; raises UsageError."""
    args = build_parser().parse_args(argv)
    if args.hfsdp and args.hsdp_shard is None:
        raise UsageError("--hfsdp needs --hsdp-shard (the ranks each replica shards over)")
    for name in ("micro_batch_size", "seq_length", "tensor_model_parallel_size", "hsdp_shard"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if args.check and max(args.world_sizes) > 8:
        raise UsageError("--check runs every rank on this machine: keep --world-sizes at 8 or below")
    if args.ranks_per_node < 1:
        raise UsageError("--ranks-per-node must be at least 1")
    if args.probe and not args.predict:
        raise UsageError("--probe is what --predict computes with: give --predict too")
    if args.grad_reduce_dtype == "fp32":
        args.grad_reduce_dtype = None  # the estimator's "no low-bit reduction"
    return args
