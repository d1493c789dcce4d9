"""The user-visible communication account: how many collectives of each kind
ran, and how many bytes their buffers covered, on this rank."""

from __future__ import annotations

import threading
from collections import defaultdict


class CommAccount:
    """Counts per collective kind. ``bytes`` is the size of the full (unsharded)
    buffer each collective covers, so it can be compared with model sizes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])

    def add(self, kind: str, nbytes: int) -> None:
        with self._lock:
            entry = self._counts[kind]
            entry[0] += 1
            entry[1] += nbytes

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {kind: {"count": c, "bytes": b} for kind, (c, b) in sorted(self._counts.items())}

    def total_bytes(self) -> int:
        return sum(entry["bytes"] for entry in self.snapshot().values())


_ACCOUNT = CommAccount()


def comm_account() -> CommAccount:
    """The process-wide account (one per rank)."""
    return _ACCOUNT
