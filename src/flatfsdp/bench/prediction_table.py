"""The predicted step beside the measured one (``--predict``): per contender,
the error, what the prediction is made of, and the communication it leaves
exposed beside the host's measured waits."""

from __future__ import annotations


def attach(summary: dict, predictions: dict[str, dict]) -> None:
    """Put each contender's prediction (or why there is none) in its summary row."""
    for name, predicted in predictions.items():
        if name in summary["rows"]:
            row = summary["rows"][name]
            row["predicted"] = predicted
            if "step_s" in predicted:
                row["prediction_error"] = predicted["step_s"] / row["step_s"] - 1


def _exposed(predicted: dict) -> str:
    exposed = {tier: s for tier, s in predicted["exposed"].items() if s >= 0.0005}
    total = sum(predicted["exposed"].values())
    return f"{total:.3f}" + (f" ({', '.join(f'{t} {s:.3f}' for t, s in exposed.items())})" if exposed else "")


def _row(row: dict) -> str | None:
    predicted = row.get("predicted")
    if predicted is None:
        return None
    if "error" in predicted:
        return f"| {row['label']} | {row['step_s']:.3f} | not predicted: {predicted['error']} | | | | | | | |"
    waited = "--" if row.get("exposed_s") is None else f"{row['exposed_s']:.3f}"
    cpu = row.get("host_cpu_s")
    measured_cpu = "--" if cpu is None else f"{cpu[0]:.3f} / {cpu[1]:.3f}"
    phases = predicted["by_phase"]
    return (f"| {row['label']} | {row['step_s']:.3f} | {predicted['step_s']:.3f} "
            f"| {100 * row['prediction_error']:+.1f}% "
            f"| {predicted['compute_s']:.3f} ({phases.get('engine', 0):.3f}) | {predicted['host_comm_s']:.3f} "
            f"| {measured_cpu} | {_exposed(predicted)} | {waited} | {predicted['tflops']:.3g} |")


def prediction_table(summary: dict) -> str:
    rows = [line for line in map(_row, summary["rows"].values()) if line]
    if not rows:
        return ""
    assumptions = next((r["predicted"]["assumptions"] for r in summary["rows"].values()
                        if "assumptions" in r.get("predicted", {})), [])
    lines = ["Predicted beside measured (flatfsdp.estimator: the engine's schedule from a fake-world run of the "
             "same setup, replayed on the compute and link models below):", "",
             "| contender | measured step s | predicted step s | error | predicted compute s (engine ops) "
             "| predicted host CPU for comm s | measured CPU s, main thread / other threads "
             "| predicted exposed comm s (by link) | measured host waited s | predicted model TFLOP/s/rank |",
             "|---|---|---|---|---|---|---|---|---|---|"] + rows
    notes = ["measured CPU: a median step's, the mean over ranks (bench/host_cpu.py). Where ranks fill the cores, "
             "the main thread's is what the predicted compute models, the other threads' (gloo's) what the "
             "predicted host CPU for comm does"]
    return "\n".join(lines + [""] + [f"* {a}" for a in assumptions + notes])
