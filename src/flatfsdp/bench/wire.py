"""The wire limit: how fast a step could be if only the throttled link mattered.

A step cannot end before its bytes have crossed the link: the *wire limit* is
the bytes that crossed per step over the link's rate, in the busiest
direction. Behind one link (one namespace's loopback) every packet passes the
one token bucket, both directions together, so there is one "direction"; two
nodes are joined by a bucket each way, which run at once, so the slower
direction sets the limit. Nor can a step beat the no-communication floor: the
line to beat is ``max(floor, wire limit)``, and ``step / line`` says how much
of the step is neither compute nor unavoidable transfer (overlap missed,
latency, the CPU time of the transfer itself).

Pure arithmetic on measured figures (``link_counters`` measures them).
"""

from __future__ import annotations

import re

# tc's rate units (tc(8), "RATES"): bits per second by SI or IEC prefix, or bytes per second ("bps").
_BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
         "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40}
_BYTES = {"bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12,
          "kibps": 2**10, "mibps": 2**20, "gibps": 2**30, "tibps": 2**40}


def parse_rate(text: str) -> float:
    """Bytes per second of a tc rate such as "2gbit" (250e6) or "100mbps" (100e6).

    A bare number is refused: tc reads it as bits, people often mean bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", text or "")
    unit = match.group(2).lower() if match else ""
    if not match or (unit not in _BITS and unit not in _BYTES):
        raise SystemExit(f"--link {text!r}: expected a rate in tc's units, e.g. 2gbit, 500mbit or 100mbps")
    value = float(match.group(1))
    rate = value * _BITS[unit] / 8 if unit in _BITS else value * _BYTES[unit]
    if rate <= 0:
        raise SystemExit(f"--link {text!r}: the rate must be positive")
    return rate


def wire_limit_s(direction_bytes: list[float], rate_bytes_per_s: float) -> float:
    """Seconds the busiest direction needs for its bytes at the link's rate."""
    return max(direction_bytes, default=0.0) / rate_bytes_per_s


def line_to_beat(floor_s: float | None, wire_s: float) -> float:
    """``max(floor, wire limit)``; without a floor run, the wire limit alone."""
    return wire_s if floor_s is None else max(floor_s, wire_s)


def interface_directions(link: dict) -> list[float]:
    """Bytes per step per throttled direction, from the interface counters:
    one link: what left the namespace's loopback (each packet once); two
    nodes: what left each node's end of the wire (node 0 -> 1, node 1 -> 0)."""
    return list(link["iface_tx"])


def engine_directions(link: dict) -> list[float] | None:
    """The same directions from the engine's own account of the messages it
    posted: behind one link every message crosses it; between nodes only those
    to a peer on the other node. None where the engine keeps no account."""
    if link.get("engine_intra") is None:
        return None
    if link["nodes"] == 1:
        return [sum(link["engine_intra"]) + sum(link["engine_inter"])]
    return list(link["engine_inter"])


def wire_figures(step_s: float, link: dict | None, rate_bytes_per_s: float, floor_s: float | None,
                 no_link_s: float | None = None) -> dict:
    """One contender's row behind the link. ``link`` None: a run on loopback
    (the floor), whose line is its own time. ``no_link_s``: the same
    contender's step without the link (``--link-penalty``): the penalty is
    step / no-link step, and against what the link must cost at least,
    step / max(no-link step, wire limit)."""
    if link is None:
        line = step_s if floor_s is None else floor_s
        return dict(behind_link=False, line_s=line, step_vs_line=step_s / line)
    iface, engine = interface_directions(link), engine_directions(link)
    wire_s = wire_limit_s(iface, rate_bytes_per_s)
    line = line_to_beat(floor_s, wire_s)
    penalty = {} if no_link_s is None else dict(penalty=step_s / no_link_s,
                                                 penalty_vs_wire=step_s / max(no_link_s, wire_s))
    return dict(behind_link=True, iface_bytes=iface, engine_bytes=engine, wire_s=wire_s,
                engine_wire_s=None if engine is None else wire_limit_s(engine, rate_bytes_per_s),
                line_s=line, step_vs_line=step_s / line, **penalty)
