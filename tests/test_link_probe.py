"""The probe of the bench's simulated link (bench/link_probe.py): the rate it
reports is the bytes the model says cross the link over the time the
engine's exchange took, and the prediction takes the link at that rate."""

from __future__ import annotations

import os

import pytest

from flatfsdp.bench.link_probe import LINK_PROBE_MBYTES, carried_rates, link_key, probe_link
from flatfsdp.bench.netsim import missing_for_link
from flatfsdp.bench.options import parse
from flatfsdp.bench.prediction import link_note, models_for
from flatfsdp.estimator.compute_cost import OpRates
from flatfsdp.estimator.probe import MachineProbe

MB = 1 << 20


def _measured(waiting_gbytes_s: float, computing_gbytes_s: float) -> dict:
    return dict(waiting_gbytes_s={"exchange": waiting_gbytes_s}, computing_gbytes_s={"exchange": computing_gbytes_s})


def test_two_nodes_rate_counts_what_crosses_between_them():
    cfg = parse(["--nnodes", "2", "--link", "1gbit", "--nproc-per-node", "2"])[0]
    # Each rank sends 3 quarters of 64 MB (48 MB) to its 3 peers at 0.06 GB/s: 0.8 s. The two
    # ranks of a node each send 2 quarters across: 64 MB through the node's egress in 0.8 s.
    rates = carried_rates(cfg, 64 * MB, _measured(0.06, 0.03))
    assert rates["nominal_bytes_s"] == 125e6
    assert rates["waiting_bytes_s"] == pytest.approx(0.06e9 * 4 / 3)
    assert rates["computing_bytes_s"] == pytest.approx(0.03e9 * 4 / 3)
    assert link_key(cfg) == "1gbit, 2 nodes of 2"


def test_one_shared_link_counts_both_ranks_bytes():
    cfg = parse(["--link", "2gbit", "--nproc-per-node", "2"])[0]
    # Both ranks' halves go through the one bucket: twice what one rank sent.
    rates = carried_rates(cfg, 64 * MB, _measured(0.125, 0.1))
    assert rates["waiting_bytes_s"] == pytest.approx(0.25e9)
    assert rates["computing_bytes_s"] == pytest.approx(0.2e9)
    assert link_key(cfg) == "2gbit, 1 node of 2"


def _machine(links: dict) -> MachineProbe:
    return MachineProbe(alone=OpRates(), side_by_side=OpRates(), ranks=2, cores=2, loopback_gbytes_s=1.0,
                        loopback_busy_gbytes_s=0.8, latency_s=1e-3, links=links)


def test_the_prediction_takes_the_link_as_probed_else_at_its_nominal_rate():
    cfg = parse(["--nnodes", "2", "--link", "1gbit", "--nproc-per-node", "2"])[0]
    _, fabric = models_for(cfg, "flatfsdp", _machine({}), None)
    assert (fabric.node_rate, fabric.link_rate_busy) == (125e6, None)
    assert "nominal rate: not probed" in link_note(cfg, _machine({}))
    probed = _machine({link_key(cfg): dict(nominal_bytes_s=125e6, waiting_bytes_s=110e6, computing_bytes_s=100e6)})
    _, fabric = models_for(cfg, "flatfsdp", probed, None)
    assert (fabric.node_rate, fabric.link_rate_busy, fabric.shared_rate) == (110e6, 100e6, None)
    assert "110 MB/s while the ranks wait, 100 while they compute, of 125 nominal" in link_note(cfg, probed)
    # Saved and read back with the machine's probe.
    assert MachineProbe.from_json(probed.to_json()).links == probed.links
    # The floor runs without the link.
    _, fabric = models_for(cfg, "floor", probed, None)
    assert fabric.node_rate is None and fabric.shared_rate is None


@pytest.mark.skipif(bool(missing_for_link(os.geteuid())), reason="needs root, ip and tc")
def test_probing_a_real_throttled_link_through_the_namespaces():
    cfg = parse(["--link", "2gbit", "--nproc-per-node", "2"])[0]
    rates = probe_link(cfg)
    assert rates["exchange_mbytes"] == LINK_PROBE_MBYTES
    # A token bucket of 1 MB lets little beyond its rate through in 32 MB; the exchange gets through.
    for kind in ("waiting_bytes_s", "computing_bytes_s"):
        assert 0 < rates[kind] < 1.25 * rates["nominal_bytes_s"]
