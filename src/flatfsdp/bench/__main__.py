"""`python -m flatfsdp.bench` (also `flatfsdp bench`): run the contenders,
print the tables, write results.json and chart.png under --out (and, as each
run ends, its record to runs.jsonl there: run_records.py)."""

from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path

import torch

from flatfsdp.bench.chart import write_chart
from flatfsdp.bench.link_runs import run_behind_link
from flatfsdp.bench.options import PROG, BenchConfig, parse
from flatfsdp.bench.prediction_table import attach
from flatfsdp.bench.report import summarise
from flatfsdp.bench.run_records import RunRecords
from flatfsdp.bench.runner import is_reporting_rank, run_all
from flatfsdp.launch import under_torchrun
from flatfsdp.bench.tables import header, markdown
from flatfsdp.cli.flags import parse_or_exit


def _environment(cfg: BenchConfig, runs: list[dict]) -> dict:
    return dict(date=datetime.date.today().isoformat(), torch=torch.__version__, python=platform.python_version(),
                machine=platform.machine(), device=runs[0]["device"] if runs else None,
                world=runs[0]["world"] if runs else cfg.nprocs, command=" ".join(sys.argv))


def write_outputs(out: Path, cfg: BenchConfig, runs: list[dict], summary: dict, env: dict) -> list[str]:
    """results.json (config, environment, summary, every run) and chart.png; returns notes."""
    out.mkdir(parents=True, exist_ok=True)
    payload = dict(config=cfg.as_dict(), environment=env, summary=summary, runs=runs)
    (out / "results.json").write_text(json.dumps(payload, indent=1, default=str))
    note = write_chart(summary, out / "chart.png", header(cfg, None, env["world"]))
    return [note] if note else []


def main(argv: list[str] | None = None) -> dict:
    return run_parsed(parse_or_exit(parse, argv, PROG))


def _predict(cfg: BenchConfig) -> tuple[dict, dict | None]:
    """Predictions of the runs (``--predict``), made before them: the probe
    measures the machine in the same session as the runs."""
    from flatfsdp.bench.prediction import predict_runs, probe_machine
    from flatfsdp.estimator.probe import MachineProbe

    if under_torchrun():
        print("note: --predict needs a process without a process group (not under torchrun): skipped",
              file=sys.stderr)
        return {}, None
    machine = None
    if cfg.predict == "probe":
        machine = (MachineProbe.from_json(json.loads(Path(cfg.probe_file).read_text())) if cfg.probe_file
                   else probe_machine(cfg))
    device = None if cfg.predict == "probe" else cfg.predict
    return predict_runs(cfg, machine, device), (machine.to_json() if machine else None)


def run_parsed(parsed: tuple[BenchConfig, str | None]) -> dict:
    """The bench on a parsed command line (flatfsdp.bench.options.parse): runs, prints, writes --out."""
    cfg, out = parsed
    records = RunRecords(Path(out) if out and is_reporting_rank() else None)
    predictions, machine = _predict(cfg) if cfg.predict else ({}, None)
    runs, notes = run_behind_link(cfg, records) if cfg.link else run_all(cfg, records=records)
    summary = summarise(cfg, runs, notes)
    attach(summary, predictions)
    if machine is not None:
        summary["probe"] = machine
    if not is_reporting_rank():
        return summary
    env = _environment(cfg, runs)
    print(markdown(cfg, summary, env["world"]), flush=True)
    if out:
        for note in write_outputs(Path(out), cfg, runs, summary, env):
            print(f"note: {note}", file=sys.stderr)
        print(f"\nwrote {Path(out) / 'results.json'}", file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()
