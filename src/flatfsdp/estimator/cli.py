"""`flatfsdp estimate`: memory and traffic per rank of a model at several world
sizes, from the engine run as one rank of a fake world (docs/scale.md). Its
flags: flatfsdp.cli.estimate_flags.

Bad input prints one line on stderr and exits with status 2.
"""

from __future__ import annotations

import json

from flatfsdp.cli.estimate_flags import PROG, parse
from flatfsdp.cli.flags import fail, parse_or_exit
from flatfsdp.estimator import report
from flatfsdp.estimator.deepspeed_formulas import deepspeed_model_states, model_counts
from flatfsdp.estimator.estimate import estimate
from flatfsdp.estimator.models import resolve_model
from flatfsdp.estimator.rank_step import STRATEGIES, Layout


def run(args) -> int:
    spec = resolve_model(args.model, units=args.units, recompute=args.recompute)
    predict = getattr(args, "predict", False)
    device_type = "cpu"
    if predict and args.probe:  # the step traced on the device the probe times it on
        from flatfsdp.estimator.probe import probe_device
        device_type = probe_device().type
    rows = []
    for strategy in args.data_parallel_sharding_strategy:
        rows += estimate(spec, args.world_sizes, strategy=strategy, shard_size=args.hsdp_shard,
                         outer_sharding=args.hfsdp, tp=args.tensor_model_parallel_size, bf16=args.bf16,
                         reduce_bf16=args.grad_reduce_in_bf16, defer_reductions=args.defer_reductions,
                         param_gather_dtype=args.param_gather_dtype, grad_reduce_dtype=args.grad_reduce_dtype,
                         micro_batch=args.micro_batch_size, seq_len=args.seq_length, trace=predict,
                         device_type=device_type)
    deepspeed = _deepspeed(spec, rows) if args.deepspeed else None
    predictions, picks, assumptions = _time(args, rows) if predict else (None, {}, [])
    if device_type != "cpu":
        assumptions.append(f"schedule: traced on fake {device_type} tensors, the ops the probe timed")
    if args.json:
        print(json.dumps(report.as_json(args.model, rows, deepspeed, predictions, picks)
                         | {"assumptions": assumptions}, indent=2))
    else:
        header, cells, unit = report.table_cells(rows, deepspeed)
        if predictions is not None:
            report.add_time_columns(header, cells, predictions, picks)
        table = report.markdown_table(header, cells) if args.markdown else report.text_table(header, cells)
        print(_title(args, rows[0][1].params))
        print(table)
        print(f"{unit} per rank; traffic in {unit} per step per rank (AG all-gather, RS reduce-scatter, AR "
              "all-reduce, over the mesh dimension named; 'world' spans every rank)")
        for line in assumptions:
            print(f"time: {line}")
    if args.check:
        return _check(args.model, [layout for layout, _ in rows])
    return 0


def _time(args, rows: list) -> tuple[list, dict[int, int], list[str]]:
    """Each row's predicted step, the pick per world size, and what the
    prediction assumed (docs/scale.md, "Time on paper")."""
    from flatfsdp.estimator.compute_cost import Throughput
    from flatfsdp.estimator.devices import DEVICES
    from flatfsdp.estimator.predict import Links, parse_link, probed, recommend, time_rows

    cluster = Links(parse_link(args.intra_link), parse_link(args.inter_link), args.ranks_per_node)
    if args.probe:
        from flatfsdp.estimator.probe import probe
        from flatfsdp.estimator.probe_steps import spec_step

        machine = probe([(spec_step, (args.model, args.micro_batch_size, args.seq_length, args.bf16, args.recompute))])
        compute, links = probed(machine, cluster)  # the cluster's links where the probe timed an accelerator
    else:
        device = Throughput(DEVICES[args.device])
        compute = lambda layout: device  # noqa: E731
        links = cluster
    predictions = time_rows(rows, compute, links)
    picks = recommend(rows, predictions, args.memory_gib * 2**30)
    fabric = links.fabric(rows[0][0])
    return predictions, picks, [compute(rows[0][0]).describe(), fabric.describe(),
                                f"pick: the fastest layout whose peak fits {args.memory_gib:g} GiB"]


def _title(args, params: int) -> str:
    grads = args.grad_reduce_dtype or ("bf16" if args.grad_reduce_in_bf16 else "fp32")
    precision = (f"bf16 compute, fp32 main weights, {grads} gradient reduction" if args.bf16
                 else f"fp32, {grads} gradient reduction")
    if args.param_gather_dtype:
        precision += f", {args.param_gather_dtype} weight gathers"
    return (f"{args.model}: {params / 1e9:.3g} B parameters, {precision}, AdamW, micro-batch "
            f"{args.micro_batch_size} x {args.seq_length} tokens, recompute {args.recompute}")


def _deepspeed(spec, rows: list) -> list[int | None]:
    params, largest = model_counts(spec.build())
    stage = {name: i for i, name in enumerate(STRATEGIES)}
    # Tensor parallelism is not one of DeepSpeed's estimator's cases.
    return [None if layout.tp > 1 else deepspeed_model_states(stage[layout.strategy], params, largest, layout.shard)
            for layout, _ in rows]


def _check(model: str, layouts: list[Layout]) -> int:
    from flatfsdp.estimator.verify import compare

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
    run_args(parse_or_exit(parse, argv, PROG))


def run_args(args) -> None:
    """The command on a parsed command line (flatfsdp.cli.estimate_flags); exits with its status."""
    try:
        code = run(args)
    except ValueError as exc:
        fail(PROG, str(exc))
    raise SystemExit(code)
