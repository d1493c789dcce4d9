"""log.json in the run directory: the configuration, every step's loss and
speed, evaluations, memory per rank, the summary. Rewritten atomically at each
log point, so a crash or Ctrl-C leaves the last complete version, never half a file."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def write_atomically(path: str, data: bytes) -> None:
    """Write to a temporary file beside ``path``, fsync, rename over it."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-" + os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class RunLog:
    def __init__(self, path: str, config: dict[str, Any]):
        self.path = path
        self.record: dict[str, Any] = {"config": config, "steps": [], "evals": [], "memory": [],
                                       "events": [], "summary": None}

    def step(self, **entry: Any) -> None:
        self.record["steps"].append(entry)

    def eval(self, **entry: Any) -> None:
        self.record["evals"].append(entry)

    def memory(self, step: int, per_rank_mb: list[list[float]]) -> None:
        keys = ("rss_mb", "peak_rss_mb", "device_mb", "peak_device_mb")
        self.record["memory"].append({"step": step, "ranks": [dict(zip(keys, row)) for row in per_rank_mb]})

    def event(self, step: int, what: str) -> None:
        self.record["events"].append({"step": step, "event": what})

    def finish(self, summary: dict[str, Any]) -> None:
        self.record["summary"] = summary
        self.write()

    def write(self) -> None:
        write_atomically(self.path, json.dumps(self.record, indent=1).encode() + b"\n")
