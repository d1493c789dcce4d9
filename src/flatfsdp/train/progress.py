"""What rank 0 shows while training: a live bar in a terminal (rich, else
tqdm, else our own carriage-return line -- no hard dependency), plain lines at
log points when stdout is not a terminal or with --no-progress.

Every backend shows the same text: step, loss, learning rate, tokens/s and
memory per rank (refreshed at log points, the only time ranks report it).
"""

from __future__ import annotations

import os
import shutil
import sys


def memory_text(per_rank_mb: list[list[float]] | None) -> str:
    if not per_rank_mb:
        return ""
    column = 2 if any(row[2] for row in per_rank_mb) else 0  # accelerator bytes when there are any
    values = [row[column] for row in per_rank_mb]
    kind = "dev" if column else "rss"
    if len(values) <= 4:
        return f"{kind} MB/rank {' '.join(f'{v:,.0f}' for v in values)}"
    return f"{kind} MB/rank max {max(values):,.0f}"


def status_text(loss: float, lr: float, tokens_per_s: float, memory: str) -> str:
    parts = [f"loss {loss:.4f}", f"lr {lr:.1e}", f"{tokens_per_s:,.0f} tok/s"]
    return " | ".join(parts + ([memory] if memory else []))


class PlainLines:
    """One line per log point; the base the live bars refine."""

    def __init__(self, total: int, first_step: int):
        self.total, self.first_step = total, first_step
        self.memory = ""

    def step(self, step: int, loss: float, lr: float, tokens_per_s: float, log_point: bool,
             memory: list[list[float]] | None = None) -> None:
        if memory:
            self.memory = memory_text(memory)
        self._show(step, status_text(loss, lr, tokens_per_s, self.memory), log_point)

    def _show(self, step: int, text: str, log_point: bool) -> None:
        if log_point:
            print(f"step {step:>{len(str(self.total))}}/{self.total} | {text}", flush=True)

    def note(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        pass


class LineBar(PlainLines):
    """Our own: a bar redrawn in place with a carriage return."""

    def _show(self, step: int, text: str, log_point: bool) -> None:
        width = shutil.get_terminal_size((100, 20)).columns
        done = (step - self.first_step) / max(1, self.total - self.first_step)
        bar = "#" * round(20 * done) + "." * (20 - round(20 * done))
        line = f"step {step}/{self.total} [{bar}] {text}"[:width - 1]
        sys.stdout.write("\r" + line.ljust(width - 1))
        sys.stdout.flush()

    def note(self, text: str) -> None:
        sys.stdout.write("\r" + " " * (shutil.get_terminal_size((100, 20)).columns - 1) + "\r")
        print(text, flush=True)

    def close(self) -> None:
        sys.stdout.write("\n")
        sys.stdout.flush()


class TqdmBar(PlainLines):
    def __init__(self, total: int, first_step: int):
        super().__init__(total, first_step)
        from tqdm import tqdm
        self._tqdm = tqdm
        self.bar = tqdm(total=total, initial=first_step, unit="step", file=sys.stdout, dynamic_ncols=True)

    def _show(self, step: int, text: str, log_point: bool) -> None:
        self.bar.set_postfix_str(text, refresh=False)
        self.bar.update(step - self.bar.n)

    def note(self, text: str) -> None:
        self._tqdm.write(text, file=sys.stdout)

    def close(self) -> None:
        self.bar.close()


class RichBar(PlainLines):
    def __init__(self, total: int, first_step: int):
        super().__init__(total, first_step)
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        self.progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(bar_width=24),
                                 TimeRemainingColumn(), TextColumn("{task.description}"),
                                 console=Console(file=sys.stdout), transient=False)
        self.task = self.progress.add_task("", total=total, completed=first_step)
        self.progress.start()

    def _show(self, step: int, text: str, log_point: bool) -> None:
        self.progress.update(self.task, completed=step, description=text)

    def note(self, text: str) -> None:
        self.progress.console.print(text, markup=False, highlight=False)

    def close(self) -> None:
        self.progress.stop()


def make_progress(total: int, first_step: int, *, live: bool, backend: str | None = None) -> PlainLines:
    """``live``: a bar is wanted (rank 0, no --no-progress); it is drawn only on a
    terminal. ``backend`` (or FLATFSDP_PROGRESS) forces rich / tqdm / line / plain."""
    if not live or not sys.stdout.isatty():
        return PlainLines(total, first_step)
    choice = backend or os.environ.get("FLATFSDP_PROGRESS")
    bars = {"rich": RichBar, "tqdm": TqdmBar, "line": LineBar, "plain": PlainLines}
    if choice in bars:
        return bars[choice](total, first_step)
    for bar in (RichBar, TqdmBar):
        try:
            return bar(total, first_step)
        except ImportError:
            continue
    return LineBar(total, first_step)
