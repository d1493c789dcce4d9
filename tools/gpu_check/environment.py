"""What machine a GPU check ran on: device, driver, torch / CUDA / NCCL
versions, which optional packages are present. Writes JSON; part of
tools/gpu_check.sh.

    python tools/gpu_check/environment.py --mode cuda|cpu --out environment.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
from pathlib import Path

OPTIONAL = ("pytest", "torchao", "numpy", "transformers", "matplotlib", "deepspeed")
"""Packages some checks or figures use; the report says which were missing."""


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(command: list[str]) -> str | None:
    if shutil.which(command[0]) is None:
        return None
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def _cuda(torch) -> dict:
    """The CUDA device's figures (only called where the check runs on CUDA)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return dict(device=props.name, capability=f"sm_{props.major}{props.minor}",
                memory_gib=round(props.total_memory / 2**30, 1), devices=torch.cuda.device_count(),
                cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                nccl=".".join(map(str, torch.cuda.nccl.version())),
                driver=_run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]))


def _changed(root: Path) -> int:
    """Tracked files that differ from the commit: the run measured that tree,
    not the commit alone (the first GPU report ran fixes made after it)."""
    status = _run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"])
    return len(status.splitlines()) if status else 0


def probe(mode: str, root: Path) -> dict:
    import torch

    info = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), mode=mode,
                python=platform.python_version(), torch=torch.__version__, cpus=os.cpu_count(),
                machine=platform.machine(), packages={p: _version(p) for p in OPTIONAL},
                commit=_run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"]), changed_files=_changed(root))
    if mode == "cuda":
        info.update(_cuda(torch))
    else:
        info.update(device=f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    info = probe(args.mode, Path(__file__).resolve().parents[2])
    Path(args.out).write_text(json.dumps(info, indent=1))
    print(f"[environment] {info['device']}, torch {info['torch']}", flush=True)


if __name__ == "__main__":
    main()
