"""bench/cells.py's two tables from its cells' summaries: predicted beside
measured (every run that was predicted), and each contender's link penalty."""

from __future__ import annotations

from pathlib import Path


def _load(result: dict) -> str:
    (before, _, _), (after, _, _) = result["load"]
    return f"{before:.2f} -> {after:.2f}"


def _net_of_floor(rows: dict, name: str, error: float) -> str:
    """The error beside the floor's in the same cell: the floor has no
    communication and no engine, so its own error is how far this machine
    drifted from its probe (another job's load, its speed of the moment);
    where compute makes the step, what is left is the model's. Behind a slow
    link the step is the link's, and the floor's drift does not carry over."""
    floor = rows.get("floor", {})
    if name == "floor" or "prediction_error" not in floor:
        return "--"
    return f"{100 * ((1 + error) / (1 + floor['prediction_error']) - 1):+.1f}%"


def _cpu(predicted: dict, row: dict) -> str:
    """The step's host CPU, predicted / measured (bench/host_cpu.py): the main
    thread's against the predicted compute, the other threads' against the
    predicted host CPU of communication."""
    cpu = row.get("host_cpu_s")
    main, other = ("--", "--") if cpu is None else (f"{cpu[0]:.3f}", f"{cpu[1]:.3f}")
    return f"{predicted['compute_s']:.3f} / {main}; {predicted['host_comm_s']:.3f} / {other}"


def predicted_rows(results: dict[str, dict]) -> list[str]:
    rows = []
    for cell, result in results.items():
        for name, row in result["summary"]["rows"].items():
            predicted = row.get("predicted")
            if not predicted:
                continue
            lo, hi = row["step_s_range"]
            if "error" in predicted:
                rows.append(f"| {cell} | {row['label']} | {row['step_s']:.3f} ({lo:.3f}-{hi:.3f}) "
                            f"| not predicted: {predicted['error']} | | | | | | {_load(result)} |")
                continue
            exposed = sum(predicted["exposed"].values())
            waited = "--" if row.get("exposed_s") is None else f"{row['exposed_s']:.3f}"
            ok = "yes" if abs(row["prediction_error"]) <= 0.10 else "**no**"
            rows.append(f"| {cell} | {row['label']} | {row['step_s']:.3f} ({lo:.3f}-{hi:.3f}) "
                        f"| {predicted['step_s']:.3f} | {100 * row['prediction_error']:+.1f}% | {ok} "
                        f"| {_net_of_floor(result['summary']['rows'], name, row['prediction_error'])} "
                        f"| {_cpu(predicted, row)} | {exposed:.3f} / {waited} | {_load(result)} |")
    return rows


def penalty_rows(results: dict[str, dict]) -> list[str]:
    rows = []
    for cell, result in results.items():
        for row in result["summary"]["rows"].values():
            wire = row.get("wire", {})
            if "penalty" not in wire:
                continue
            rows.append(f"| {cell} | {row['label']} | {row['step_s']:.3f} | {row['no_link_step_s']:.3f} "
                        f"| {wire['wire_s']:.3f} | {wire['penalty']:.3f} x | {wire['penalty_vs_wire']:.3f} x "
                        f"| {_load(result)} |")
    return rows


def write_report(path: Path, predicted: list[str], penalty: list[str]) -> str:
    parts = []
    if predicted:
        parts += ["Predicted beside measured (one probe, taken first; nothing fitted per cell):", "",
                  "| cell | contender | measured step s (run range) | predicted s | error | within 10% "
                  "| error net of the floor's | CPU s, predicted / measured: main thread; other threads "
                  "| exposed comm s, predicted / measured host waits | load average, before -> after |",
                  "|---|---|---|---|---|---|---|---|---|---|"] + predicted + [""]
    if penalty:
        parts += ["Link penalty behind 2 Gbit/s (each contender against its own run without the link, same rounds):",
                  "", "| cell | contender | step behind s | step without s | wire limit s | penalty "
                  "| behind / max(without, wire) | load average, before -> after |",
                  "|---|---|---|---|---|---|---|---|"] + penalty
    text = "\n".join(parts)
    path.write_text(text + "\n")
    return text
