"""`python -m flatfsdp.bench` (also `flatfsdp bench`): run the contenders,
print the tables, write results.json and chart.png under --out."""

from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path

import torch

from flatfsdp.bench.chart import write_chart
from flatfsdp.bench.link_runs import run_behind_link
from flatfsdp.bench.options import BenchConfig, build_parser, config_from_args, parse_args
from flatfsdp.bench.report import summarise
from flatfsdp.bench.runner import is_reporting_rank, run_all
from flatfsdp.bench.tables import header, markdown


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
    parser = build_parser()
    args = parse_args(parser, argv)
    cfg = config_from_args(args)
    runs, notes = run_behind_link(cfg) if cfg.link else run_all(cfg)
    summary = summarise(cfg, runs, notes)
    if not is_reporting_rank():
        return summary
    env = _environment(cfg, runs)
    print(markdown(cfg, summary, env["world"]), flush=True)
    if args.out:
        for note in write_outputs(Path(args.out), cfg, runs, summary, env):
            print(f"note: {note}", file=sys.stderr)
        print(f"\nwrote {Path(args.out) / 'results.json'}", file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()
