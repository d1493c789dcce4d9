"""The table of a run behind a throttled link: per contender the bytes that
crossed the link per step -- measured at the interface and, where the engine
keeps an account, by the engine -- the wire limit they imply, the line to beat
``max(floor, wire limit)`` and the step's ratio to it (bench/wire.py)."""

from __future__ import annotations

from flatfsdp.bench.options import BenchConfig
from flatfsdp.bench.report import MB
from flatfsdp.bench.timeline_table import timeline_table
from flatfsdp.bench.wire import parse_rate


def _mb(values: list[float] | None) -> str:
    """Bytes per direction; two nodes: "node 0 -> 1 / node 1 -> 0"."""
    return "--" if values is None else " / ".join(f"{v / MB:.1f}" for v in values)


def _s(value: float | None) -> str:
    return "--" if value is None else f"{value:.3f}"


def _native(link: dict) -> str:
    native = link.get("native_all_reduce")
    if native is None:
        return "all (native gloo collectives)"
    return ", ".join(f"{b / MB:.1f} over {dim}" for dim, b in native.items()) or "--"


def _row(row: dict) -> str:
    wire, link = row["wire"], row["link"]
    if not wire["behind_link"]:
        return (f"| {row['label']} | {row['step_s']:.3f} | loopback (no communication) | -- | -- | -- | -- | -- "
                f"| {wire['line_s']:.3f} | {wire['step_vs_line']:.2f} x |")
    split = ("--" if link["engine_intra"] is None
             else f"{sum(link['engine_intra']) / MB:.1f} / {sum(link['engine_inter']) / MB:.1f}")
    return (f"| {row['label']} | {row['step_s']:.3f} | {_mb(wire['iface_bytes'])} | {_mb(wire['engine_bytes'])} "
            f"| {split} | {_native(link)} | {_s(wire['wire_s'])} | {_s(wire['engine_wire_s'])} "
            f"| {wire['line_s']:.3f} | {wire['step_vs_line']:.2f} x |")


def describe_link(cfg: BenchConfig) -> str:
    rate = parse_rate(cfg.link) / MB  # MB = 2**20 bytes, as in the tables above
    if cfg.nodes == 1:
        return (f"Behind one link of {cfg.link} ({rate:.0f} MB/s): every rank in one network namespace whose "
                "loopback is token-bucket limited, both directions sharing the rate (one node: the engine's "
                "messages all count as intra-node, and all of them cross the link).")
    return (f"Two simulated nodes of {cfg.nprocs} ranks joined by a link of {cfg.link} ({rate:.0f} MB/s) each way "
            "(a veth pair, throttled per direction); ranks of a node talk over its own, unthrottled loopback. "
            "HSDP/HFSDP: replicas across the nodes, shards within one.")


def _waits(row: dict) -> str:
    behind, without = row.get("exposed_s"), row.get("no_link_exposed_s")
    return "--" if behind is None else f"{behind:.3f} / {without:.3f}" if without is not None else f"{behind:.3f}"


def penalty_table(summary: dict) -> str:
    """``--link-penalty``: what the link cost each contender, against its own step without it."""
    rows = [row for row in summary["rows"].values() if "penalty" in row.get("wire", {})]
    if not rows:
        return ""
    lines = ["Link penalty: each contender behind the link against its own run without it, in the same rounds:",
             "",
             "| contender | step behind the link s | step without it s (range) | penalty (behind / without) "
             "| behind / max(without, wire limit) | host waited s, behind / without |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lo, hi = row["no_link_range"]
        lines.append(f"| {row['label']} | {row['step_s']:.3f} | {row['no_link_step_s']:.3f} ({lo:.3f}-{hi:.3f}) "
                     f"| {row['wire']['penalty']:.3f} x | {row['wire']['penalty_vs_wire']:.3f} x | {_waits(row)} |")
    return "\n".join(lines)


def wire_table(cfg: BenchConfig, summary: dict) -> str:
    direction = "" if cfg.nodes == 1 else " (node 0 -> 1 / 1 -> 0)"
    lines = [describe_link(cfg), "",
             f"| contender | step s | crossing MB/step, interface{direction} | crossing MB/step, engine{direction} "
             "| engine p2p MB/step intra / inter node (all ranks) | engine native all-reduce MB/rank (not split per peer) "
             "| wire limit s (interface) | wire limit s (engine) | line = max(floor, wire) s | step / line |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_row(row) for row in summary["rows"].values() if "wire" in row]
    lines += ["",
              "* crossing bytes are measured, per timed step: *interface* = tx_bytes of the throttled device "
              f"(`{'lo' if cfg.nodes == 1 else 'wire'}`) read inside the namespace(s) around the timed steps "
              "(headers, acknowledgements and native collectives included: what the token bucket charged); "
              "*engine* = payload of the point-to-point messages flatfsdp posted to peers across the link "
              "(flatfsdp.comm_account().sent_by_peer(), split by torchrun's LOCAL_WORLD_SIZE).",
              "* gloo's own collectives (FSDP2's gathers and reductions, flatfsdp's all-reduces: HSDP's outer "
              "gradient reduction) route bytes inside gloo, so no engine sees their per-peer traffic: only the "
              "interface column counts them; the engine's all-reduce buffer sizes are listed beside it.",
              "* wire limit = crossing bytes of the busiest direction / rate; line = max(no-comm floor, wire limit "
              "from the interface); the floor has no communication in its timed steps, so it runs on loopback, "
              "unthrottled."]
    extra = [table for table in (penalty_table(summary), timeline_table(summary)) if table]
    return "\n\n".join(["\n".join(lines)] + extra)
