"""`python -m flatfsdp.bench.cells`: every measurement the time model and the
links are held to (issue 53), in one command, so it can be re-run as is on a
quiet machine:

* **predicted beside measured**: one probe of this machine (both batch
  shapes and each simulated link, taken once, first), then each cell --
  loopback small and large batch at 1, 2 and 4 ranks; behind one 2 Gbit/s link, small and large, fp32
  and int8 weights + bf16 gradients; two nodes at 1 Gbit/s, ZeRO-3, HSDP and
  HFSDP -- benched with ``--predict --probe-file``: the prediction of every
  flatfsdp run (and the floor's) beside its measurement;
* **link penalty**: large batch (tied GPT, its tied unit, an untied GPT) and
  small batch behind 2 Gbit/s with ``--link-penalty``: each contender's step
  behind the link against its own without it.

Writes DIR/cells.md (the two tables, with the load average each cell ran
under) and each cell's bench output under DIR/<cell>/. Needs root for the
links (see docs/benchmarks.md); ``--only predicted|penalty`` runs one half.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

SMALL, LARGE = ["--preset", "small-batch"], ["--preset", "large-batch"]
UNTIED = ["--untie-embeddings-and-output-weights", "--vocab-size", "8192", "--num-layers", "8", "--hidden-size", "512",
          "--num-attention-heads", "8"]
LOWBIT = ["--param-gather-dtype", "int8", "--grad-reduce-dtype", "bf16"]


@dataclass(frozen=True)
class Cell:
    name: str
    argv: tuple[str, ...]


def _cell(name: str, *argv: str) -> Cell:
    return Cell(name, tuple(argv))


PREDICTED = (
    _cell("loopback-small-2", *SMALL, "--contenders", "floor,fsdp2,flatfsdp"),
    _cell("loopback-large-2", *LARGE, "--contenders", "floor,fsdp2,flatfsdp"),
    _cell("loopback-small-1", *SMALL, "--nproc-per-node", "1", "--contenders", "floor,flatfsdp"),
    _cell("loopback-large-1", *LARGE, "--nproc-per-node", "1", "--contenders", "floor,flatfsdp"),
    _cell("loopback-small-4", *SMALL, "--nproc-per-node", "4", "--contenders", "floor,flatfsdp"),
    _cell("2gbit-small-fp32", *SMALL, "--link", "2gbit", "--contenders", "floor,flatfsdp"),
    _cell("2gbit-large-fp32", *LARGE, "--link", "2gbit", "--contenders", "floor,flatfsdp"),
    _cell("2gbit-small-int8w-bf16g", *SMALL, "--link", "2gbit", *LOWBIT, "--contenders", "floor,flatfsdp"),
    _cell("2gbit-large-int8w-bf16g", *LARGE, "--link", "2gbit", *LOWBIT, "--contenders", "floor,flatfsdp"),
    _cell("2nodes-1gbit-small", *SMALL, "--nnodes", "2", "--link", "1gbit",
          "--contenders", "floor,flatfsdp,flatfsdp-hsdp,flatfsdp-hfsdp"),
)
PENALTY = (
    _cell("penalty-large-tied", *LARGE, "--link", "2gbit", "--link-penalty", "--contenders", "fsdp2,flatfsdp"),
    _cell("penalty-large-tied-unit", *LARGE, "--tied-embedding-unit", "--link", "2gbit", "--link-penalty",
          "--contenders", "flatfsdp"),
    _cell("penalty-large-untied", *LARGE, *UNTIED, "--link", "2gbit", "--link-penalty",
          "--contenders", "fsdp2,flatfsdp"),
    _cell("penalty-small-tied", *SMALL, "--link", "2gbit", "--link-penalty", "--contenders", "fsdp2,flatfsdp"),
)


def probe_once(out: Path, extra: list[str]) -> Path:
    """One probe of this machine for both batch shapes of the bench GPT, and of
    each throttled link the cells run behind; saved for every cell."""
    from flatfsdp.bench.options import parse
    from flatfsdp.bench.prediction import probe_machine

    shapes = [parse(list(shape) + extra)[0] for shape in (SMALL, LARGE)]
    links = [cfg for cfg in (parse(list(cell.argv) + extra)[0] for cell in PREDICTED) if cfg.link]
    machine = probe_machine(shapes[0], shapes, links)
    path = out / "probe.json"
    path.write_text(json.dumps(machine.to_json()))
    return path


def run_cell(cell: Cell, out: Path, extra: list[str], probe: Path | None) -> dict:
    from flatfsdp.bench.__main__ import main as bench_main

    where = out / cell.name
    argv = list(cell.argv) + extra + ["--out", str(where)] + (["--probe-file", str(probe)] if probe else [])
    before = os.getloadavg()
    summary = bench_main(argv)
    load = [before, os.getloadavg()]
    results = where / "results.json"
    if results.is_file():  # the load it ran under, for predict_again's table
        results.write_text(json.dumps(json.loads(results.read_text()) | {"load": load}, indent=1, default=str))
    return dict(summary=summary, load=load, argv=argv)


def predict_again(out: Path) -> dict[str, dict]:
    """The cells already measured under ``out``, their predictions made again
    from the same saved probe (the time model changed; the runs did not)."""
    from flatfsdp.bench.options import BenchConfig
    from flatfsdp.bench.prediction import predict_runs
    from flatfsdp.bench.prediction_table import attach
    from flatfsdp.estimator.probe import MachineProbe

    machine = MachineProbe.from_json(json.loads((out / "probe.json").read_text()))
    results = {}
    for cell in PREDICTED:
        path = out / cell.name / "results.json"
        if not path.is_file():
            continue
        saved = json.loads(path.read_text())
        cfg = BenchConfig.from_dict(saved["config"])
        attach(saved["summary"], predict_runs(cfg, machine))
        results[cell.name] = dict(summary=saved["summary"], load=saved.get("load", [[0, 0, 0], [0, 0, 0]]))
    return results


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flatfsdp.bench.cells", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-out/cells", help="directory for cells.md and each cell's output")
    p.add_argument("--only", choices=("predicted", "penalty"), help="run one half")
    p.add_argument("--repeats", default="2", help="alternating rounds per cell (default 2)")
    p.add_argument("--steps", default=None, help="timed steps per run (default: the bench's)")
    p.add_argument("--predict-again", action="store_true",
                   help="run nothing: make the predictions of the cells already under --out again, from the probe "
                        "saved there, and write cells.md")
    p.add_argument("--bench-args", default="", metavar="'FLAGS'",
                   help="more bench flags for every cell, e.g. a smaller model for a smoke run")
    return p


def main(argv: list[str] | None = None) -> None:
    from flatfsdp.bench.cells_report import penalty_rows, predicted_rows, write_report

    args = _parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = ["--repeats", args.repeats] + (["--steps", args.steps] if args.steps else []) + args.bench_args.split()
    results: dict[str, dict] = {}
    if args.predict_again:
        results = predict_again(out)
        report = write_report(out / "cells.md", predicted_rows(results), [])
        print(report)
        return
    if args.only in (None, "predicted"):
        probe = probe_once(out, extra)
        for cell in PREDICTED:
            results[cell.name] = run_cell(cell, out, extra, probe)
    if args.only in (None, "penalty"):
        for cell in PENALTY:
            results[cell.name] = run_cell(cell, out, extra, None)
    report = write_report(out / "cells.md", predicted_rows(results), penalty_rows(results))
    print(report)
    print(f"\nwrote {out / 'cells.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
