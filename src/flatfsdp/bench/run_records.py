"""One JSON record per run, appended to ``<out>/runs.jsonl`` as each run ends.

results.json is written once every run is done; a bench stopped before that
(a time limit, a hang, a crash) still leaves the records of the runs that
finished, one line each: the run's record as ``report.summarise`` reads it
(step times, peak bytes, losses, bytes, ...) or, for a run that failed,
``{"contender", "round", "failed": why}``. Readers (tools/gpu_check) feed
them to ``report.summarise`` and get the very figures results.json would
hold, computed by the same code.
"""

from __future__ import annotations

import json
from pathlib import Path

RUNS_FILE = "runs.jsonl"


class RunRecords:
    """Where a bench writes its runs' records (``out`` None: nowhere)."""

    def __init__(self, out: Path | None) -> None:
        self.path = None if out is None else Path(out) / RUNS_FILE
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")  # this bench's runs only

    def ran(self, record: dict) -> None:
        self._append(record)

    def failed(self, contender: str, round_: int, why: str) -> None:
        self._append(dict(contender=contender, round=round_, failed=why))

    def _append(self, record: dict) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record, default=str) + "\n")


def read_runs(path: Path) -> tuple[list[dict], dict[str, str]]:
    """The records of the runs that finished, in run order, and a note per
    contender that failed. A last line cut off mid-write is left out."""
    runs, notes = [], {}
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "failed" in record:
            notes[record["contender"]] = f"failed in round {record['round'] + 1}: {record['failed']}"
        else:
            runs.append(record)
    return runs, notes
