"""The benchmark's configuration: one frozen record built from the command line.

Imports no torch (a dtype is looked up when asked for): `flatfsdp bench --help`
and a bad flag answer before torch is imported. Flags `flatfsdp train` and
`estimate` have too are defined once in flatfsdp.cli.flags.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from flatfsdp.bench import gpu_preset
from flatfsdp.estimator.devices import DEVICES
from flatfsdp.bench.wire import parse_rate
from flatfsdp.cli import flags
from flatfsdp.cli.flags import STRATEGIES, UsageError

if TYPE_CHECKING:
    import torch

PROG = "flatfsdp bench"
PREDICT_DEVICES = tuple(sorted(DEVICES))

CONTENDERS = ("floor", "fsdp2", "flatfsdp", "deepspeed")
VARIANTS = ("flatfsdp-nocheck", "flatfsdp-fullbit", "fsdp2-compiled", "flatfsdp-compiled",
            "fsdp2-hsdp", "flatfsdp-hsdp", "flatfsdp-hfsdp")
"""Run only when named: flatfsdp with a per-step safety check turned off, to
measure what the check costs in the same run (docs/reliability.md); flatfsdp
without its low-bit gathers/reductions (docs/lowbit.md); FSDP2 and
flatfsdp with the whole sharded model under ``torch.compile`` (docs/compile.md);
on a 2-D (outer, shard) mesh, FSDP2's HSDP, flatfsdp's HSDP and its HFSDP
(main weights and optimizer state sharded across the outer dimension too)."""
"""Every contender the bench knows, in report order."""

PRESETS = {"small-batch": dict(batch=1, seq_len=64), "large-batch": dict(batch=4, seq_len=256),
           "gpu": gpu_preset.SHAPE}
"""Micro batch per rank x tokens per sequence. small-batch is communication-bound
on CPU + gloo (little compute per byte gathered), large-batch compute-bound;
gpu is a 1.2B Llama on one GPU (bench/gpu_preset.py)."""
PRESET_DEFAULTS = {"gpu": gpu_preset.DEFAULTS}
"""Presets that choose more than the batch shape: their command-line defaults."""
PRESET_MODELS = {"gpu": gpu_preset.MODEL}
"""Presets that train another model than the GPT."""

_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
"""--grad-reduce-dtype names -> torch dtype names."""


@dataclass(frozen=True)
class BenchConfig:
    layers: int = 12
    """Transformer blocks (each one FSDP unit)."""
    d_model: int = 384
    """Residual width. With 12 layers, 6 heads, vocab 32000 and a 256-position
    table the GPT has 33,680,640 parameters (the 33.7M of DESIGN.md)."""
    heads: int = 6
    """Attention heads per block."""
    vocab: int = 32000
    """Token ids; the output projection is tied to the embedding unless ``untied``."""
    untied: bool = False
    """The GPT's output projection has a weight of its own; the token table
    and the head are then FSDP units of their own (bench/workload.py, embedding_units)."""
    tied_unit: bool = False
    """flatfsdp: a tied token table and output head are one unit of their own,
    not the root's (ZeRO-3: the lookup fetches rows, the head's gradient is
    reduced first; bench/workload.py, embedding_units). FSDP2 keeps them in the root."""
    context: int = 256
    """Rows of the position table, fixed so both presets train the same model."""
    seq_len: int = 256
    """Tokens per sequence fed to the model (at most ``context``)."""
    batch: int = 4
    """Sequences per rank per step (the micro batch)."""
    steps: int = 5
    """Timed steps per run."""
    warmup: int = 2
    """Untimed steps per run before the timed ones (lazy init, allocator warm-up)."""
    repeats: int = 2
    """Rounds of the alternating schedule (each round runs every contender once)."""
    nprocs: int = 2
    """Ranks to launch locally (ignored under torchrun)."""
    threads_per_rank: int = 1
    """Intra-op threads per rank (torch.set_num_threads)."""
    bf16: bool = False
    """Compute in bf16 with fp32 main weights and optimizer state."""
    grad_reduce_dtype: str = "fp32"
    """fp32, bf16 (flatfsdp: also with fp32 compute) or int8 (flatfsdp only: block-scaled codes)."""
    param_gather_dtype: str | None = None
    """flatfsdp gathers weights as int8 or fp8 codes (the others gather in the compute dtype)."""
    """Dtype gradients are reduced in under --bf16 ("fp32" or "bf16")."""
    strategy: str = "optim_grads_params"
    """flatfsdp's zero_dp_strategy."""
    contenders: tuple[str, ...] = CONTENDERS
    """Contenders to run, in this order within each round."""
    lr: float = 1e-3
    """AdamW learning rate (weight decay 0.01, foreach), the same for all."""
    seed: int = 0
    """Seeds the model's init and the batches."""
    loss_tol: float | None = None
    """Largest |loss - reference| still counted as agreement; None: by precision."""
    preset: str | None = None
    """The preset the batch shape came from, for the report."""
    link: str | None = None
    """Rate of the throttled link the ranks run behind, in tc's units ("2gbit");
    None: plain loopback, no namespace (docs/benchmarks.md, "Behind a slow link")."""
    nodes: int = 1
    """Simulated nodes behind ``link`` (1 or 2), ``nprocs`` ranks each; HSDP's
    outer dimension is then the node dimension."""
    link_penalty: bool = False
    """With ``link``: each contender also runs on plain loopback, right after its
    run behind the link, so the report can say what the link cost it."""
    link_timeline: bool = False
    """With ``link``: rank 0 samples the link's byte counter through the timed
    steps and marks each step's phases, so the report says when the link sat
    idle and in which phase (bench/link_activity.py)."""
    predict: str | None = None
    """Predict each flatfsdp run's step (and the floor's) beside its measurement:
    "probe" (this machine, probed before the runs) or a device of
    flatfsdp.estimator.devices (its published throughput); None: no prediction."""
    probe_file: str | None = None
    """With ``predict="probe"``: a probe saved earlier (JSON, ``MachineProbe.to_json``)
    instead of probing now (bench/cells.py probes once for all its cells)."""
    model: str = "gpt"
    """"gpt" (models/gpt.py), or "llama" (models/llama.py, ``--preset gpu``: Llama
    3.2 1B's ratios at ``layers`` x ``d_model``, ``heads`` query heads; ``context`` unused)."""

    @property
    def compute_dtype(self) -> "torch.dtype":
        import torch

        return torch.bfloat16 if self.bf16 else torch.float32

    @property
    def reduce_dtype(self) -> "torch.dtype":
        import torch

        return getattr(torch, _DTYPES.get(self.grad_reduce_dtype, "float32")) if self.bf16 else torch.float32

    @property
    def tolerance(self) -> float:
        # Reduction order differs between engines; bf16 rounding amplifies it.
        if self.loss_tol is not None:
            return self.loss_tol
        # Low-bit weights or gradients change flatfsdp's numbers by design (its
        # loss check is a 400-step run: docs/lowbit.md); as bf16 rounding does.
        lowbit = self.param_gather_dtype is not None or self.grad_reduce_dtype != "fp32"
        return 5e-2 if self.bf16 or lowbit else 2e-3

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "BenchConfig":
        """The inverse of ``as_dict`` after a JSON round trip (ranks behind a link read it from a file)."""
        return cls(**{**values, "contenders": tuple(values["contenders"])})


def add_tied_unit_flag(p: argparse.ArgumentParser) -> None:
    """For the commands that shard the bench's units (the bench, bench.trace)."""
    p.add_argument("--tied-embedding-unit", dest="tied_unit", action="store_true",
                   help="flatfsdp: the tied token table and output head are one unit of their own, not the root's; "
                        "under ZeRO-3 the lookup fetches only its ids' rows and the head's gradient is reduced first")


def add_model_flags(p: argparse.ArgumentParser, d: BenchConfig) -> None:
    """The bench GPT's shape, under the names every command gives it (also for bench.trace, bench.save_stall)."""
    flags.add(p, "--num-layers", dest="layers", default=d.layers, note="each one FSDP unit")
    flags.add(p, "--hidden-size", dest="d_model", default=d.d_model)
    flags.add(p, "--num-attention-heads", dest="heads", default=d.heads)
    flags.add(p, "--vocab-size", dest="vocab", default=d.vocab,
              note="the output projection is tied to the embedding unless --untie-embeddings-and-output-weights")
    flags.add(p, "--untie-embeddings-and-output-weights", dest="untied",
              note="the bench's GPT; the token table and the head are then FSDP units of their own")


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or flags.CommandParser(prog=PROG, description="flatfsdp against FSDP2, DeepSpeed and the compute "
                                                             "floor: medians, ratios, bytes and memory against "
                                                             "their minimum. See docs/benchmarks.md.")
    d = BenchConfig()
    p.add_argument("--preset", choices=sorted(PRESETS), help="micro batch x tokens: small-batch 1x64, large-batch "
                   "4x256 (default: large-batch; --micro-batch-size / --seq-length override it); gpu: a 1.2B "
                   "Llama, 4x4096, bf16, one GPU (bench/gpu_preset.py; a flag given overrides what it chose)")
    add_model_flags(p, d)
    add_tied_unit_flag(p)
    flags.add(p, "--max-position-embeddings", dest="context", default=None,
              default_text="max(256, --seq-length), so both presets train the same model")
    flags.add(p, "--seq-length", dest="seq_len", default=None, default_text="the preset's")
    flags.add(p, "--micro-batch-size", dest="batch", default=None, default_text="the preset's")
    p.add_argument("--steps", type=int, default=d.steps, metavar="N", help="timed steps per run")
    p.add_argument("--warmup", type=int, default=d.warmup, metavar="N",
                   help="untimed steps per run before the timed ones")
    p.add_argument("--repeats", type=int, default=d.repeats, metavar="N",
                   help="rounds of the alternating schedule, each running every contender once")
    flags.add(p, "--nproc-per-node", dest="nprocs", default=d.nprocs)
    p.add_argument("--threads-per-rank", type=int, default=d.threads_per_rank, metavar="N",
                   help="intra-op threads per rank (torch.set_num_threads)")
    flags.add(p, "--bf16")
    flags.add(p, "--grad-reduce-dtype", default=d.grad_reduce_dtype,
              note="FSDP2 and DeepSpeed follow it with --bf16 only; int8: flatfsdp only")
    flags.add(p, "--param-gather-dtype", default=None, default_text="the compute dtype",
              note="flatfsdp only (the others gather in the compute dtype)")
    flags.add(p, "--data-parallel-sharding-strategy", dest="strategy", type=flags.parse_strategy, default=d.strategy,
              note="flatfsdp's zero_dp_strategy")
    p.add_argument("--contenders", default=",".join(d.contenders), metavar="NAME,NAME,...",
                   help=f"comma list from {','.join(CONTENDERS + VARIANTS)}")
    flags.add(p, "--lr", default=d.lr, note="constant, weight decay 0.01, the same for every contender")
    flags.add(p, "--seed", default=d.seed)
    p.add_argument("--loss-tol", type=float, default=None, metavar="X", help="largest |loss - reference| still "
                   "counted as agreement (default: 2e-3 fp32, 5e-2 bf16 or low-bit)")
    p.add_argument("--link", default=None, metavar="RATE",
                   help="run the ranks behind one link throttled to RATE (tc units: 2gbit, 500mbit); needs root "
                        "(default: plain loopback)")
    p.add_argument("--link-penalty", action="store_true",
                   help="with --link: run each contender on plain loopback too, right after its run behind the link, "
                        "and report its link penalty (step behind the link / step without it)")
    p.add_argument("--link-timeline", action="store_true",
                   help="with --link: sample the link's byte counter every 2 ms through the timed steps and "
                        "report, per phase of the step, how long the link sat idle (each contender, rank 0)")
    flags.add(p, "--nnodes", dest="nodes", default=d.nodes, choices=(1, 2),
              note="simulated, with --link: joined by the link, --nproc-per-node ranks each")
    flags.add(p, "--predict", note="of the floor and every flatfsdp run, printed beside each measured step")
    p.add_argument("--predict-device", default=None, choices=PREDICT_DEVICES,
                   help="with --predict: compute from this device's published throughput (default: a probe of "
                        "this machine, taken in the same session)")
    p.add_argument("--probe-file", default=None, metavar="FILE",
                   help="with --predict: a probe of this machine saved earlier (JSON) (default: probe now)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="directory for results.json and chart.png (default: print the tables only)")
    return p


def parse(argv: list[str]) -> tuple[BenchConfig, str | None]:
    """The configuration and --out of a command line; raises UsageError."""
    parser = build_parser()
    defaults = PRESET_DEFAULTS.get(_preset_named(argv))
    if defaults:
        unknown = set(defaults) - {action.dest for action in parser._actions}
        if unknown:  # a renamed flag must not leave a preset silently half-applied
            raise ValueError(f"preset defaults {sorted(unknown)} are no flag's destination")
        parser.set_defaults(**defaults)  # before parsing: a flag given explicitly still wins
    args = parser.parse_args(argv)
    try:
        return config_from_args(args), args.out
    except SystemExit as exc:  # config_from_args's own refusals (it also serves callers of its own)
        raise UsageError(str(exc.code)) from None


def _preset_named(argv: list[str] | None) -> str | None:
    """The value of --preset in ``argv`` (abbreviations are refused: it is spelled whole)."""
    argv = list(argv or [])
    for i, word in enumerate(argv):
        if word == "--preset" and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith("--preset="):
            return word.split("=", 1)[1]
    return None


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    preset = args.preset or ("large-batch" if args.batch is None and args.seq_len is None else None)
    shape = dict(PRESETS[preset]) if preset else dict(batch=BenchConfig.batch, seq_len=BenchConfig.seq_len)
    if args.batch is not None:
        shape["batch"] = args.batch
    if args.seq_len is not None:
        shape["seq_len"] = args.seq_len
    names = tuple(n.strip() for n in args.contenders.split(",") if n.strip())
    unknown = sorted(set(names) - set(CONTENDERS) - set(VARIANTS))
    if unknown or not names:
        raise SystemExit(f"unknown contender(s) {unknown}: choose from {', '.join(CONTENDERS)}")
    if min(args.steps, args.repeats, args.nprocs, args.threads_per_rank) < 1 or args.warmup < 0:
        raise SystemExit("--steps, --repeats, --nproc-per-node and --threads-per-rank must be >= 1, --warmup >= 0")
    if args.link is not None:
        parse_rate(args.link)  # refuse a rate tc would misread before anything starts
    elif args.nodes > 1:
        raise SystemExit("--nnodes 2 needs --link RATE: the simulated nodes are joined by a throttled link")
    if args.link_penalty and args.link is None:
        raise SystemExit("--link-penalty needs --link RATE: it compares each run behind the link with one without")
    if args.link_timeline and args.link is None:
        raise SystemExit("--link-timeline needs --link RATE: it samples the throttled link's byte counter")
    context = args.context or max(256, shape["seq_len"])
    if shape["seq_len"] > context:
        raise SystemExit(f"--seq-length {shape['seq_len']} exceeds --max-position-embeddings {context}")
    if args.untied and PRESET_MODELS.get(args.preset, "gpt") != "gpt":
        raise SystemExit("--untie-embeddings-and-output-weights applies to the GPT, not --preset gpu's Llama")
    return BenchConfig(layers=args.layers, d_model=args.d_model, heads=args.heads, vocab=args.vocab,
                       untied=args.untied, tied_unit=args.tied_unit, context=context, steps=args.steps,
                       warmup=args.warmup, repeats=args.repeats,
                       nprocs=args.nprocs, threads_per_rank=args.threads_per_rank, bf16=args.bf16,
                       grad_reduce_dtype=args.grad_reduce_dtype, param_gather_dtype=args.param_gather_dtype,
                       strategy=args.strategy, contenders=names,
                       lr=args.lr, seed=args.seed, loss_tol=args.loss_tol,
                       preset=preset if args.batch is None and args.seq_len is None else None,
                       link=args.link, nodes=args.nodes, model=PRESET_MODELS.get(args.preset, "gpt"),
                       link_penalty=args.link_penalty, link_timeline=args.link_timeline, predict=_prediction(args),
                       probe_file=args.probe_file, **shape)


def _prediction(args: argparse.Namespace) -> str | None:
    """What the prediction computes with: "probe" (this machine) or a device
    name; None: no prediction. A device or a probe file implies --predict."""
    if not (args.predict or args.predict_device or args.probe_file):
        return None
    if args.predict_device and args.probe_file:
        raise SystemExit("--predict-device and --probe-file are two sources of compute times: give one")
    return args.predict_device or "probe"
