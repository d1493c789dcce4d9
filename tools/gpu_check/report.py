"""The GPU check's report: report.md and report.json from what the phases of
tools/gpu_check.sh left in its output folder.

    python tools/gpu_check/report.py OUT_DIR --bench-args "--preset gpu ..."

Reads environment.json, phases.txt (one "name exit-status seconds" line a
phase), device_checks.json, and the bench's bench/results.json -- or, for a
bench cut off by its time limit, bench/runs.jsonl, the record of each run
that finished (flatfsdp/bench/run_records.py), summarised by the bench's own
report.summarise, so the figures are the ones results.json would hold.
Whatever is missing is said so, not guessed.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

TIMED_OUT = 124
"""timeout(1)'s exit status when it stopped a phase."""


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_phases(path: Path) -> list[dict]:
    phases = []
    if path.exists():
        for line in path.read_text().splitlines():
            name, status, seconds = line.split()
            phases.append(dict(name=name, status=int(status), seconds=float(seconds),
                               timed_out=int(status) == TIMED_OUT))
    return phases


# ---- the bench -------------------------------------------------------------------------------

def bench_config(bench_args: list[str]):
    """The BenchConfig those arguments give, and the model's parameter count (built on the meta device)."""
    import torch

    from flatfsdp.bench.options import parse
    from flatfsdp.bench.workload import build_model

    cfg, _ = parse(bench_args)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in build_model(cfg).parameters())
    return cfg, n_params


def rows_from_summary(summary: dict) -> tuple[list[dict], dict[str, str]]:
    """The report's rows from the bench's summary (bench/report.summarise)."""
    rows = []
    for name, row in summary["rows"].items():
        rows.append(dict(contender=name, runs=row["runs"], step_s=row["step_s"], tokens_per_s=row["tokens_per_s"],
                         tflops_per_rank=row["tflops_per_rank"], peak_gb=row["peak_mb"] / 1024,
                         share_over_floor=row["share_over_floor"], time_vs_fsdp2=row["time_vs_fsdp2"],
                         last_loss=row["last_loss"], loss_ok=row["loss_ok"], host_waited_s=row.get("exposed_s")))
    return rows, dict(summary["notes"])


def _summary_of_finished_runs(out: Path, cfg) -> dict | None:
    """What the bench's own report makes of the runs that finished (None: no records)."""
    from flatfsdp.bench.report import summarise
    from flatfsdp.bench.run_records import RUNS_FILE, read_runs

    path = out / "bench" / RUNS_FILE
    if not path.exists():
        return None
    runs, notes = read_runs(path)
    return summarise(cfg, runs, notes)


def bench_section(out: Path, bench_args: list[str], phase: dict | None) -> dict:
    cfg, n_params = bench_config(bench_args)
    results = _read_json(out / "bench" / "results.json")
    log_path = out / "bench.log"
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    if results is not None:
        summary, source = results["summary"], "bench/results.json"
    else:
        summary = _summary_of_finished_runs(out, cfg) or dict(rows={}, notes={})
        source = "bench/runs.jsonl (the bench did not finish: runs that did)"
    rows, notes = rows_from_summary(summary)
    from flatfsdp.bench.tables import header, markdown

    full = markdown(cfg, results["summary"], results["runs"][0]["world"]) if results and results["runs"] else None
    tail = "\n".join(log.strip().splitlines()[-40:])
    return dict(command=f"python -m flatfsdp.bench {shlex.join(bench_args)}", source=source, rows=rows, notes=notes,
                n_params=n_params, header=header(cfg, n_params, cfg.nprocs), phase=phase, tables=full,
                log_tail=None if results else tail, config=cfg.as_dict())


# ---- the report ------------------------------------------------------------------------------

def build(out: Path, bench_args: list[str]) -> dict:
    phases = read_phases(out / "phases.txt")
    checks = _read_json(out / "device_checks.json") or {}
    by_name = {p["name"]: p for p in phases}
    return dict(environment=_read_json(out / "environment.json") or {}, phases=phases,
                checks=checks.get("checks", []), checks_phase=by_name.get("checks"),
                bench=bench_section(out, bench_args, by_name.get("bench")))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def _num(value, fmt: str, suffix: str = "") -> str:
    return "--" if value is None else format(value, fmt) + suffix


def _tree(env: dict) -> str:
    """The commit, and whether the tree that ran had changed it."""
    if not env.get("commit"):
        return "not a git checkout"
    changed = env.get("changed_files") or 0
    return env["commit"] + (f" with uncommitted changes to {changed} tracked file(s)" if changed else "")


def _environment_lines(env: dict, phases: list[dict]) -> list[str]:
    packages = env.get("packages", {})
    present = ", ".join(f"{k} {v}" for k, v in packages.items() if v) or "none"
    missing = ", ".join(k for k, v in packages.items() if not v) or "none"
    cuda = (f"CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, NCCL {env.get('nccl')}, driver {env.get('driver')}"
            if env.get("mode") == "cuda" else "no CUDA: the CPU equivalents ran (a dry run; no GPU figures)")
    device = env.get("device", "unknown")
    if env.get("capability"):
        device += f" ({env['capability']}, {env['memory_gib']} GiB, {env['devices']} visible)"
    ran = ", ".join(f"{p['name']} {p['seconds']:.0f} s" + (" (TIMED OUT)" if p["timed_out"] else
                                                            f" (exit {p['status']})" if p["status"] else "")
                    for p in phases)
    return ["| | |", "|---|---|", f"| device | {device} |", f"| torch | {env.get('torch')}; {cuda} |",
            f"| python, CPUs | {env.get('python')}, {env.get('cpus')} |",
            f"| optional packages | present: {present}; missing: {missing} |",
            f"| tree | {_tree(env)} |", f"| run | {env.get('date')}: {ran} |"]


def _check_lines(checks: list[dict], phase: dict | None) -> list[str]:
    counts = {o: sum(1 for c in checks if c["outcome"] == o) for o in ("passed", "failed", "skipped")}
    other = len(checks) - sum(counts.values())
    title = (f"## Device checks: {counts['passed']} passed, {counts['failed'] + other} failed, "
             f"{counts['skipped']} skipped")
    lines = [title, "", "tests/device_checks.py, one process each (tests/run_device_checks.py).", ""]
    if phase and phase["timed_out"]:
        lines += [f"**The checks were stopped at {phase['seconds']:.0f} s**: those missing below never reported.", ""]
    lines += ["| check | outcome | s | figures, or why |", "|---|---|---|---|"]
    for c in checks:
        detail = "; ".join(f"{k} {_fmt(v)}" for k, v in (c.get("figures") or {}).items())
        if c["outcome"] != "passed":
            detail = (c.get("message") or "").strip().splitlines()[-1:][0] if c.get("message") else ""
        lines.append(f"| {c['name']} | {c['outcome']} | {c.get('seconds', 0):.1f} | {detail.replace('|', '/')} |")
    failed = [c for c in checks if c["outcome"] not in ("passed", "skipped")]
    for c in failed:
        lines += ["", f"### {c['name']}: {c['outcome']}", "", "```", (c.get("message") or "").strip(), "```"]
    return lines


def _bench_lines(bench: dict) -> list[str]:
    phase = bench["phase"]
    lines = ["## Bench", "", f"`{bench['command']}` -- {bench['header']}", "",
             f"Figures from {bench['source']}."]
    if phase and phase["timed_out"]:
        lines.append(f"**The bench was stopped at {phase['seconds']:.0f} s.**")
    lines += ["", "| contender | runs | step s | tokens/s | model TFLOP/s per rank | peak GB "
              "| share of the step over the floor | time vs FSDP2 | last loss |", "|---|---|---|---|---|---|---|---|---|"]
    for r in bench["rows"]:
        loss = _num(r.get("last_loss"), ".4f") + (" **MISMATCH**" if r.get("loss_ok") is False else "")
        lines.append(f"| {r['contender']} | {r['runs']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} "
                     f"| {r['tflops_per_rank']:.3g} | {r['peak_gb']:.2f} | {_num(r['share_over_floor'], '.1%')} "
                     f"| {_num(r['time_vs_fsdp2'], '.2f', ' x')} | {loss} |")
    lines += [""] + [f"* {name}: {why}" for name, why in bench["notes"].items()]
    lines.append("* peak GB: the allocator's max_memory_allocated above what the rank held before the model "
                 "(on CPU: resident-set high-water mark); model TFLOP/s: bench/flops.py")
    if bench["tables"]:
        lines += ["", "### The bench's own tables", "", bench["tables"]]
    if bench["log_tail"]:
        lines += ["", "### End of bench.log", "", "```", bench["log_tail"], "```"]
    return lines


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# flatfsdp GPU check: {env.get('device', 'unknown device')}", ""]
    lines += _environment_lines(env, report["phases"]) + [""]
    lines += _check_lines(report["checks"], report["checks_phase"]) + [""]
    return "\n".join(lines + _bench_lines(report["bench"])) + "\n"


def passed(report: dict) -> bool:
    """Every check passed or could not run here, and the bench finished with every contender."""
    checks_ok = bool(report["checks"]) and all(c["outcome"] in ("passed", "skipped") for c in report["checks"])
    bench = report["bench"]
    return checks_ok and bench["source"] == "bench/results.json" and not bench["notes"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the folder tools/gpu_check.sh wrote into")
    parser.add_argument("--bench-args", default="", help="the arguments the bench ran with")
    args = parser.parse_args(argv)
    out = Path(args.out)
    report = build(out, shlex.split(args.bench_args))
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    text = markdown(report)
    (out / "report.md").write_text(text)
    print(text)
    return 0 if passed(report) else 1


if __name__ == "__main__":
    raise SystemExit(main())
