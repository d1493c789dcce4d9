"""loss.png: training loss per step and evaluation loss, with matplotlib when it
is installed, else drawn by our own canvas (png.py) -- the file always exists."""

from __future__ import annotations

import io
import math

from flatfsdp.train.png import Canvas
from flatfsdp.train.runlog import write_atomically

TRAIN_COLOR, EVAL_COLOR, AXIS_COLOR, GRID_COLOR = (31, 119, 180), (214, 39, 40), (40, 40, 40), (225, 225, 225)


def plot_losses(path: str, train: list[tuple[int, float]], evals: list[tuple[int, float]],
                title: str = "", use_matplotlib: bool = True) -> str:
    """Write the curve to ``path``; returns which renderer drew it. NaN/inf
    points are left out (they have no place on an axis)."""
    train = [(s, v) for s, v in train if math.isfinite(v)]
    evals = [(s, v) for s, v in evals if math.isfinite(v)]
    if use_matplotlib:
        try:
            _matplotlib(path, train, evals, title)
            return "matplotlib"
        except ImportError:
            pass
    write_atomically(path, _canvas(train, evals).png_bytes())
    return "builtin"


def _matplotlib(path: str, train, evals, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")  # no display needed, and never a GUI window from a training run
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        axes.plot(*zip(*train), label="train", color=[c / 255 for c in TRAIN_COLOR], linewidth=1)
    if evals:
        axes.plot(*zip(*evals), "o-", label="eval (held out)", color=[c / 255 for c in EVAL_COLOR])
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats per byte)")
    axes.set_title(title, fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    write_atomically(path, buffer.getvalue())


def _canvas(train, evals, width: int = 640, height: int = 360) -> Canvas:
    canvas = Canvas(width, height)
    left, right, top, bottom = 60, width - 20, 20, height - 40
    points = [p for p in train + evals if math.isfinite(p[1])]
    if not points:
        return canvas
    x_lo, x_hi = min(p[0] for p in points), max(p[0] for p in points)
    y_lo, y_hi = min(p[1] for p in points), max(p[1] for p in points)
    x_hi, y_hi = max(x_hi, x_lo + 1), max(y_hi, y_lo + 1e-6)

    def to_px(step: float, loss: float) -> tuple[float, float]:
        return (left + (step - x_lo) / (x_hi - x_lo) * (right - left),
                bottom - (loss - y_lo) / (y_hi - y_lo) * (bottom - top))

    for i in range(5):  # horizontal grid lines with their loss values
        loss = y_lo + (y_hi - y_lo) * i / 4
        _, y = to_px(x_lo, loss)
        canvas.line(left, y, right, y, GRID_COLOR)
        label = f"{loss:.2f}"
        canvas.text(left - 6 - Canvas.text_width(label), round(y) - 5, label, AXIS_COLOR)
    canvas.line(left, top, left, bottom, AXIS_COLOR)
    canvas.line(left, bottom, right, bottom, AXIS_COLOR)
    for step in (x_lo, (x_lo + x_hi) // 2, x_hi):
        x, _ = to_px(step, y_lo)
        canvas.text(round(x) - Canvas.text_width(str(step)) // 2, bottom + 8, str(step), AXIS_COLOR)
    canvas.text(right - Canvas.text_width("step"), bottom + 24, "step", AXIS_COLOR)
    _polyline(canvas, [to_px(*p) for p in train], TRAIN_COLOR, 2)
    _polyline(canvas, [to_px(*p) for p in evals], EVAL_COLOR, 3)
    canvas.text(left + 10, top, "train", TRAIN_COLOR)
    if evals:
        canvas.text(left + 60, top, "eval", EVAL_COLOR)
    return canvas


def _polyline(canvas: Canvas, pixels: list[tuple[float, float]], color, thick: int) -> None:
    for (x0, y0), (x1, y1) in zip(pixels, pixels[1:]):
        canvas.line(x0, y0, x1, y1, color, thick)
    for x, y in pixels[:1] if len(pixels) == 1 else []:
        canvas.rect(round(x) - 2, round(y) - 2, round(x) + 2, round(y) + 2, color)
