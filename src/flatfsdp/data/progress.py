"""A progress bar for tokenizing: on a terminal tqdm if installed, else rich,
else a plain line every few seconds (imported only when a bar is shown, never
required); in a pipe or a log file always the plain lines -- a bar's
carriage-return frames would fill a log with hundreds of half-lines."""

from __future__ import annotations

import sys
import time


class _Plain:
    def __init__(self, total: int, label: str, every_s: float = 5.0):
        self.total, self.label, self.every_s = total, label, every_s
        self.done, self.started, self.last = 0, time.perf_counter(), 0.0

    def update(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.last >= self.every_s:
            self.last = now
            mb_s = self.done / max(now - self.started, 1e-9) / 1e6
            print(f"{self.label}: {100 * self.done / max(self.total, 1):5.1f}% ({mb_s:.1f} MB/s)",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


class _Rich:
    def __init__(self, total: int, label: str):
        from rich.progress import Progress

        self._progress = Progress(transient=False)
        self._task = self._progress.add_task(label, total=total)
        self._progress.start()

    def update(self, n: int) -> None:
        self._progress.advance(self._task, n)

    def close(self) -> None:
        self._progress.stop()


class _Silent:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total_bytes: int, label: str, show: bool):
    """An object with ``update(bytes)`` and ``close()``."""
    if not show:
        return _Silent()
    if not sys.stderr.isatty():
        return _Plain(total_bytes, label)
    try:
        from tqdm import tqdm

        return tqdm(total=total_bytes, desc=label, unit="B", unit_scale=True, file=sys.stderr)
    except ImportError:
        pass
    try:
        return _Rich(total_bytes, label)
    except ImportError:
        return _Plain(total_bytes, label)
