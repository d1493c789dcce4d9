"""The summary as markdown: a speed and memory table and a communication table."""

from __future__ import annotations

from flatfsdp.bench.options import BenchConfig
from flatfsdp.bench.prediction_table import prediction_table
from flatfsdp.bench.report import KINDS, MB
from flatfsdp.bench.wire_table import wire_table


def _x(value: float | None) -> str:
    return "--" if value is None else f"{value:.2f} x"


def _range(lo: float, hi: float, fmt: str) -> str:
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{format(lo, fmt)}-{format(hi, fmt)}"


def _loss(row: dict) -> str:
    text = f"{row['last_loss']:.4f}"
    if row["name"] == "floor":
        text += f" (first {row['first_loss']:.4f})"
    if row.get("loss_ok") is False:
        text += f" **MISMATCH (diff {row['loss_diff']:.2g})**"
    return text


def _share(value: float | None) -> str:
    return "--" if value is None else f"{100 * value:.1f}%"


def speed_table(summary: dict) -> str:
    lines = ["| contender | step s (median; run range) | tokens/s | model TFLOP/s/rank | peak MB/rank (range) "
             "| time vs FSDP2 | time vs floor | share over floor | mem vs FSDP2 | mem vs floor | state MB theory "
             "| last loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in summary["rows"].values():
        lines.append(
            f"| {row['label']} | {row['step_s']:.3f} ({_range(*row['step_s_range'], '.3f')}) "
            f"| {row['tokens_per_s']:,.0f} | {row['tflops_per_rank']:.3g} "
            f"| {row['peak_mb']:.0f} ({_range(*row['peak_mb_range'], '.0f')}) "
            f"| {_x(row['time_vs_fsdp2'])} | {_x(row['time_vs_floor'])} | {_share(row['share_over_floor'])} "
            f"| {_x(row['mem_vs_fsdp2'])} "
            f"| {_x(row['mem_vs_floor'])} | {row['state_mb_theory']:.0f} | {_loss(row)} |")
    return "\n".join(lines)


def _kind_cell(measured: dict, kind: str) -> str:
    entry = measured.get(kind)
    if not entry:
        return "--"
    return f"{entry['bytes'] / MB:.1f} ({entry['count']:g})"


def _other_cell(measured: dict) -> str:
    others = {k: v for k, v in measured.items() if k not in KINDS}
    if not others:
        return "--"
    return ", ".join(f"{k} {v['bytes'] / MB:.2f} ({v['count']:g})" for k, v in others.items())


def _waited(row: dict) -> str:
    """Exposed communication: the slowest rank's host wait per step, by kind (engine account only)."""
    if row.get("exposed_s") is None:
        return "--"
    kinds = ", ".join(f"{k} {v:.3f}" for k, v in row["exposed_by_kind"].items() if k != "total" and v >= 0.0005)
    return f"{row['exposed_s']:.3f}" + (f" ({kinds})" if kinds else "")


def comm_table(summary: dict) -> str:
    lines = ["| contender | counted by | all-gather MB (calls) | reduce-scatter MB (calls) | all-reduce MB (calls) "
             "| other | total MB | minimum MB | total / minimum | host waited s/step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in summary["rows"].values():
        comm = row["comm"]
        minimum = comm["min_total_bytes"]
        lines.append(
            f"| {row['label']} | {comm['source']} | "
            + " | ".join(_kind_cell(comm["measured"], k) for k in KINDS)
            + f" | {_other_cell(comm['measured'])} | {comm['total_bytes'] / MB:.1f} | {minimum / MB:.1f} "
            f"| {_x(comm['ratio_to_min'])} | {_waited(row)} |")
    return "\n".join(lines)


def header(cfg: BenchConfig, n_params: int | None, world: int) -> str:
    precision = (f"bf16 compute, fp32 main weights, {cfg.grad_reduce_dtype} gradient reduction" if cfg.bf16
                 else "fp32")
    lowbit = [f"{cfg.param_gather_dtype} weight gathers"] if cfg.param_gather_dtype else []
    if not cfg.bf16 and cfg.grad_reduce_dtype != "fp32":
        lowbit.append(f"{cfg.grad_reduce_dtype} gradient reduction")
    if lowbit:
        precision += f" (flatfsdp: {', '.join(lowbit)})"
    shape = cfg.preset or "custom"
    kind = "Llama" if cfg.model == "llama" else "GPT"
    size = f"{n_params / 1e6:.1f}M-parameter {kind}" if n_params else kind
    return (f"{size} ({cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads, vocab {cfg.vocab}), "
            f"{shape} {cfg.batch} x {cfg.seq_len} tokens per rank, {world} ranks, {precision}; "
            f"{cfg.warmup} warm-up + {cfg.steps} timed steps, {cfg.repeats} alternating rounds, "
            f"{cfg.threads_per_rank} thread(s) per rank.")


def markdown(cfg: BenchConfig, summary: dict, world: int) -> str:
    rows = list(summary["rows"].values())
    parts = [header(cfg, rows[0]["n_params"] if rows else None, world), "", speed_table(summary), "",
             "Communication per step per rank (MB of the full buffers each collective covers):", "",
             comm_table(summary)]
    notes = [f"* {name}: {why}" for name, why in summary["notes"].items()]
    if summary["loss_reference"]:
        notes.append(f"* losses compared with {summary['loss_reference']} within {summary['loss_tolerance']:g} "
                     "(the floor on its first step: its replicas never average gradients)")
    if rows:
        notes.append(f"* memory: {rows[0]['memory_method']}")
        notes.append(f"* model TFLOP/s: {rows[0]['step_flops']:.4g} FLOP per rank per step (bench/flops.py) "
                     "over the median step; share over floor: (step - floor's step) / step")
    link = ["", wire_table(cfg, summary)] if cfg.link else []
    predicted = prediction_table(summary)
    return "\n".join(parts + ([""] + notes if notes else []) + link + (["", predicted] if predicted else []))
