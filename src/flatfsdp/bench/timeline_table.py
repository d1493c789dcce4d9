"""The table of ``--link-timeline``: when the link carried bytes during each
contender's median step, phase by phase, and the spans it sat idle
(bench/link_activity.py)."""

from __future__ import annotations

from flatfsdp.bench.link_activity import IDLE_FRACTION, MIN_SPAN_S
from flatfsdp.bench.report import MB


LISTED_SPANS = 8
"""The longest spans of a step listed, in time order; the rest are counted."""


def _spans(step: dict) -> str:
    spans = step["spans"]
    if not spans:
        return "none"
    longest = sorted(sorted(spans, key=lambda s: -s["seconds"])[:LISTED_SPANS], key=lambda s: s["start_s"])
    text = "; ".join(f"{s['start_s']:.3f}-{s['start_s'] + s['seconds']:.3f} s ({s['seconds'] * 1e3:.0f} ms, "
                     f"{s['phase']})" for s in longest)
    rest = [s for s in spans if s not in longest]
    if rest:
        text += f"; and {len(rest)} shorter, {sum(s['seconds'] for s in rest) * 1e3:.0f} ms in all"
    return text


def timeline_table(summary: dict) -> str:
    timed = [row for row in summary["rows"].values() if row.get("link_timeline")]
    if not timed:
        return ""
    rate = timed[0]["link_timeline"]["rate"]
    lines = [f"Link activity (`--link-timeline`): rank 0 read the throttled interface's byte counter every "
             f"2 ms through the timed steps; the link is idle where it carried under "
             f"{IDLE_FRACTION:.0%} of its {rate / MB:.0f} MB/s. Each contender's median step (of its median run), "
             "phase by phase:", "",
             "| contender | phase | s | MB carried | link idle s |", "|---|---|---|---|---|"]
    for row in timed:
        timeline = row["link_timeline"]
        step = timeline["median_step"]
        for phase in step["phases"]:
            lines.append(f"| {row['label']} | {phase['phase']} | {phase['seconds']:.3f} | {phase['bytes'] / MB:.1f} "
                         f"| {phase['idle_s']:.3f} |")
        lines.append(f"| {row['label']} | **whole step** | {step['step_s']:.3f} | {step['bytes'] / MB:.1f} "
                     f"| {step['idle_s']:.3f} (median over the run's steps {timeline['median_idle_s']:.3f}) |")
    lines += ["", f"Idle spans of {MIN_SPAN_S * 1e3:.0f} ms or more in that step, from its start (the phase each "
              f"starts in; the {LISTED_SPANS} longest):", ""]
    lines += [f"* {row['label']}: {_spans(row['link_timeline']['median_step'])}" for row in timed]
    return "\n".join(lines)
