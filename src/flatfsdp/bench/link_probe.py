"""A probe of the bench's throttled link (``--link RATE``, one node or two):
what it carries of the engine's own traffic, for the time model.

The model took a simulated link at its nominal rate. Two nodes at 1 Gbit/s
carry less than that of the engine's exchanges (every rank sending to every
peer at once, several TCP flows through one token bucket, four ranks on two
cores): 87 to 121 MB/s of the nominal 125 in five exchanges measured on
2026-11-28. So the link is probed as the machine is: the ranks the runs
place, behind the same namespaces, post the engine's exchange
(``estimator.probe_comm``) while they wait and while they compute; the bytes
that crossed the throttled link (counted as the model counts them,
``fabric.Host.link_bytes``) over the time they took give its rate. Probed
once, before any run, and saved with the machine's probe.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from flatfsdp.bench.options import BenchConfig
from flatfsdp.bench.wire import parse_rate
from flatfsdp.engine import schedule_log
from flatfsdp.estimator import probe_comm
from flatfsdp.estimator.fabric import Host, Link, Mesh, ring_bytes

LINK_PROBE = "link-probe"
"""The name ``link_rank`` runs the probe under, in place of a contender's."""
LINK_PROBE_MBYTES = 32
"""The buffer exchanged: a few of the bench model's units, as the engine posts them back to back."""


def link_key(cfg: BenchConfig) -> str:
    """Which link a probe is of: its rate, and the ranks placed behind it."""
    return f"{cfg.link}, {cfg.nodes} node{'s' if cfg.nodes > 1 else ''} of {cfg.nprocs}"


def probe_link_rank() -> dict:
    """One rank of the probe (``link_rank`` launches it): probe_comm's figures."""
    return probe_comm.measure(LINK_PROBE_MBYTES << 20, torch.device("cpu"))


def probe_link(cfg: BenchConfig) -> dict:
    """The link ``cfg`` describes, probed with the run's ranks behind it (needs root)."""
    from flatfsdp.bench.link_runs import LinkRuns
    from flatfsdp.bench.netsim import Network, require_link_support

    require_link_support()
    with Network(cfg.link, cfg.nodes) as net, tempfile.TemporaryDirectory(prefix="flatfsdp-link-probe-") as workdir:
        measured = LinkRuns(net, cfg, Path(workdir)).behind_link(cfg, LINK_PROBE)
    return carried_rates(cfg, LINK_PROBE_MBYTES << 20, measured)


def carried_rates(cfg: BenchConfig, nbytes: int, measured: dict) -> dict:
    """Bytes/s the throttled link carried of an exchange of ``nbytes`` over
    every rank, while the ranks waited and while they computed, from probe_comm's
    rates (GB/s each rank sent)."""
    world = cfg.nprocs * cfg.nodes
    nominal = parse_rate(cfg.link)
    host = Host(Link(1.0, 0.0), {}, Mesh(cfg.nprocs, {"world": (world, 1)}),
                shared_rate=nominal if cfg.nodes == 1 else None, node_rate=nominal if cfg.nodes > 1 else None)
    record = schedule_log.Issued(0, "all_gather", nbytes, "world", world)
    # The exchange's time is what a rank sent over its rate; the link carried link_bytes in it.
    per_sent = host.link_bytes(record, nbytes) / ring_bytes(record, nbytes)
    return dict(nominal_bytes_s=nominal,
                waiting_bytes_s=measured["waiting_gbytes_s"]["exchange"] * 1e9 * per_sent,
                computing_bytes_s=measured["computing_gbytes_s"]["exchange"] * 1e9 * per_sent,
                exchange_mbytes=nbytes >> 20, measured=measured)
