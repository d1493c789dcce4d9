"""Run the device checks (tests/device_checks.py) one process each, each with a
time limit, and write their outcomes as JSON: what tools/gpu_check.sh runs.

    python tests/run_device_checks.py [--device auto|cuda|cpu] [--out FILE] [--timeout S] [--only a,b]

Needs torch and the project, not pytest. A check that crashes its process (a
CUDA error leaves the context unusable) or hangs costs only itself, and the
JSON is rewritten after every check, so a run cut short by an outer limit
still leaves what finished. Outcomes: passed, failed, skipped (the check
cannot run here, and says why), timeout, crashed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _child_env() -> dict:
    env = dict(os.environ)
    paths = [str(ROOT / "src"), str(HERE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _device(name: str):
    import torch

    from device_world import default_device

    if name == "auto":
        return default_device()
    if name == "cpu":
        return torch.device("cpu")
    return torch.device(name, torch.accelerator.current_device_index())


def run_one(name: str, device: str, workdir: Path, result: Path) -> None:
    """In a child: run one check, write its record to ``result``."""
    from device_checks import CHECKS
    from device_world import Unavailable

    start = time.perf_counter()
    record = dict(name=name)
    try:
        dev = _device(device)
        record["device"] = str(dev)
        record.update(outcome="passed", figures=CHECKS[name].run(dev, workdir))
    except Unavailable as why:
        record.update(outcome="skipped", message=str(why))
    except BaseException:  # noqa: BLE001 -- every failure is the check's finding, reported whole
        record.update(outcome="failed", message="\n".join(traceback.format_exc().splitlines()[-30:]))
    record["seconds"] = round(time.perf_counter() - start, 2)
    result.write_text(json.dumps(record, default=str))


def _spawn(name: str, device: str, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"check-{name}-") as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--one", name, "--device", device,
                   "--workdir", tmp, "--result", str(result)]
        start = time.perf_counter()
        try:
            done = subprocess.run(command, env=_child_env(), capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return dict(name=name, outcome="timeout", seconds=round(time.perf_counter() - start, 2),
                        message=f"no result within {timeout_s:g} s (killed)")
        if result.exists():
            return json.loads(result.read_text())
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-30:])
        return dict(name=name, outcome="crashed", seconds=round(time.perf_counter() - start, 2),
                    message=f"exit status {done.returncode} before a result:\n{tail}")


def run_all(device: str, out: Path, timeout_s: float, only: list[str] | None) -> list[dict]:
    from device_checks import CHECKS

    names = only or list(CHECKS)
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        raise SystemExit(f"unknown check(s) {unknown}: choose from {', '.join(CHECKS)}")
    records = []
    for name in names:
        record = _spawn(name, device, timeout_s)
        record["checks"] = CHECKS[name].checks
        records.append(record)
        out.write_text(json.dumps(dict(device=device, checks=records), indent=1, default=str))
        print(f"[checks] {name:20s} {record['outcome']:8s} {record['seconds']:6.1f} s", flush=True)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto (the accelerator if any, else cpu), cuda or cpu")
    parser.add_argument("--out", default="device_checks.json", help="where the outcomes go (JSON)")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds each check may take")
    parser.add_argument("--only", default=None, help="comma list of checks (default: all)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        run_one(args.one, args.device, Path(args.workdir), Path(args.result))
        return 0
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    records = run_all(args.device, Path(args.out), args.timeout, only)
    return 0 if all(r["outcome"] in ("passed", "skipped") for r in records) else 1


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT / "src"), str(HERE)]
    sys.exit(main())
