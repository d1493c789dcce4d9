"""chart.png: step time and peak memory per contender. matplotlib is optional
(``pip install flatfsdp[bench]``): without it the chart is skipped with a note."""

from __future__ import annotations

from pathlib import Path


def write_chart(summary: dict, path: Path, title: str) -> str | None:
    """Write the chart; return why it was skipped, or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: chart.png skipped (pip install matplotlib)"
    rows = list(summary["rows"].values())
    if not rows:
        return "no contender ran: chart.png skipped"
    labels = [r["label"] for r in rows]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    _bars(ax_t, labels, [r["step_s"] for r in rows], [r["step_s_range"] for r in rows], "step time (s), median")
    _bars(ax_m, labels, [r["peak_mb"] for r in rows], [r["peak_mb_range"] for r in rows],
          "peak memory per rank (MB)")
    fig.suptitle(title, fontsize=9, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _bars(ax, labels: list[str], values: list[float], ranges: list[list[float]], ylabel: str) -> None:
    # Error bars show the spread between the alternating runs, not a confidence interval.
    low = [v - lo for v, (lo, _) in zip(values, ranges)]
    high = [hi - v for v, (_, hi) in zip(values, ranges)]
    ax.bar(labels, values, yerr=[low, high], capsize=4, color="#4c72b0")
    for i, (v, (_, hi)) in enumerate(zip(values, ranges)):
        ax.annotate(f"{v:.0f}" if v >= 100 else f"{v:.3g}", (i, hi), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 3), textcoords="offset points")
    ax.set_ylabel(ylabel)
    ax.tick_params(axis="x", labelrotation=15, labelsize=8)
