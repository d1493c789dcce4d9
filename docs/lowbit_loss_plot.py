"""Draws docs/figures/lowbit_losses.png from the log.json of `flatfsdp train`
runs (docs/lowbit.md): held-out loss and the training loss (a 20-step mean)
of each run, side by side on one axis. Usage:
    python docs/lowbit_loss_plot.py OUT.png LABEL=RUN_DIR [LABEL=RUN_DIR ...]"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flatfsdp.train.png import Canvas

COLORS = [(40, 40, 40), (31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189)]


def curves(run_dir: str) -> tuple[list, list]:
    log = json.loads((Path(run_dir) / "log.json").read_text())
    losses = [s["loss"] for s in log["steps"]]
    smooth = [(i + 1, sum(losses[max(0, i - 19):i + 1]) / len(losses[max(0, i - 19):i + 1]))
              for i in range(len(losses))]
    return smooth, [(e["step"], e["loss"]) for e in log["evals"]]


def main(out: str, runs: list[str]) -> None:
    named = [(r.split("=", 1)[0], *curves(r.split("=", 1)[1])) for r in runs]
    width, height = 800, 420
    canvas = Canvas(width, height)
    left, right, top, bottom = 60, width - 20, 40, height - 40
    points = [p for _, train, evals in named for p in train[19:] + evals]
    x_lo, x_hi = 20, max(p[0] for p in points)
    y_lo, y_hi = min(p[1] for p in points), max(p[1] for p in points)

    def px(step, loss):
        return (left + (step - x_lo) / (x_hi - x_lo) * (right - left),
                bottom - (loss - y_lo) / (y_hi - y_lo) * (bottom - top))

    for i in range(5):
        loss = y_lo + (y_hi - y_lo) * i / 4
        _, y = px(x_lo, loss)
        canvas.line(left, y, right, y, (225, 225, 225))
        canvas.text(left - 6 - Canvas.text_width(f"{loss:.2f}"), round(y) - 5, f"{loss:.2f}", (40, 40, 40))
    canvas.line(left, top, left, bottom, (40, 40, 40))
    canvas.line(left, bottom, right, bottom, (40, 40, 40))
    for step in (x_lo, (x_lo + x_hi) // 2, x_hi):
        x, _ = px(step, y_lo)
        canvas.text(round(x) - Canvas.text_width(str(step)) // 2, bottom + 8, str(step), (40, 40, 40))
    cursor = left + 10
    for (label, train, evals), color in zip(named, COLORS):
        for a, b in zip(train[19:], train[20:]):
            canvas.line(*px(*a), *px(*b), color, 1)
        for a, b in zip(evals, evals[1:]):
            canvas.line(*px(*a), *px(*b), color, 3)
        canvas.text(cursor, 10, label, color)
        cursor += Canvas.text_width(label) + 24
    Path(out).write_bytes(canvas.png_bytes())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
