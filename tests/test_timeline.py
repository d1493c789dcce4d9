"""The time model (flatfsdp.estimator.timeline): its arithmetic on known cases,
the links' formulas, and the schedule it replays captured from the real engine
(run as rank 0 of a fake world) -- never a hand-kept copy of it."""

from __future__ import annotations

import pytest

from flatfsdp.engine import schedule_log as log
from flatfsdp.estimator import estimate
from flatfsdp.estimator.compute_cost import Throughput
from flatfsdp.estimator.devices import DEVICES
from flatfsdp.estimator.fabric import Cluster, Host, Link, Mesh
from flatfsdp.estimator.predict import Links, mesh_dims, recommend, time_rows
from flatfsdp.estimator.schedule_trace import Op, StepTrace
from flatfsdp.estimator.timeline import replay


class Clock:
    """Every op costs its ``flops`` in microseconds: the arithmetic is readable."""
    step_overhead_s = 0.0

    def seconds(self, op: Op) -> float:
        return op.flops * 1e-6

    def describe(self) -> str:
        return "test clock"


class Wire:
    """A collective occupies its link ``nbytes`` microseconds, costs the host
    ``host`` per byte once and takes ``stolen`` of its compute speed while it moves."""

    def __init__(self, host: float = 0.0, stolen: float = 0.0):
        self.host, self.share = host, stolen

    def tier(self, record) -> str:
        return record.dim

    def wire_seconds(self, record, nbytes: int, busy: bool = True) -> float:
        return nbytes * 1e-6

    def host_seconds(self, record, nbytes: int) -> float:
        return nbytes * self.host

    def stolen(self, record, nbytes: int) -> float:
        return self.share

    def describe(self) -> str:
        return "test wire"


def op(us: int, phase: str = "forward") -> Op:
    return Op("mm", us, 0, ("mm",), phase)


def issued(ticket: int, us: int, dim: str = "world", paced: bool = False) -> log.Issued:
    return log.Issued(ticket, "all_gather", us, dim, 2, paced)


def run(*records, host: float = 0.0, stolen: float = 0.0):
    return replay(StepTrace(list(records)), Clock(), Wire(host, stolen))


def test_a_collective_hidden_behind_compute_costs_nothing():
    p = run(issued(0, 500_000), op(1_000_000), log.Waited((0,)), op(1_000_000))
    assert p.step_s == pytest.approx(2.0)
    assert sum(p.exposed.values()) == 0
    assert p.busy["world"] == pytest.approx(0.5)


def test_a_wait_for_what_is_still_in_flight_is_exposed_on_its_link():
    p = run(op(1_000_000), issued(0, 2_000_000), op(1_000_000), log.Waited((0,)), op(500_000))
    assert p.exposed == {"world": pytest.approx(1.0)}
    assert p.step_s == pytest.approx(1.0 + 2.0 + 0.5)
    assert p.compute_s == pytest.approx(2.5)


def test_one_link_carries_its_collectives_in_the_order_issued():
    # The second waits behind the first: it lands at 3 s, not 1 s.
    p = run(issued(0, 2_000_000), issued(1, 1_000_000), log.Waited((1,)))
    assert p.step_s == pytest.approx(3.0)
    # On two links they travel side by side.
    p = run(issued(0, 2_000_000, "a"), issued(1, 1_000_000, "b"), log.Waited((1,)), op(10))
    assert p.exposed == {"b": pytest.approx(1.0)}


def test_a_chained_stage_starts_once_the_stage_it_follows_has_landed():
    records = [issued(0, 1_000_000, "inner"), issued(1, 1_000_000, "outer"), log.Follows((1,), (0,)),
               log.Waited((1,))]
    assert run(*records).step_s == pytest.approx(2.0)
    assert run(*records[:2], records[3]).step_s == pytest.approx(1.0)  # unchained, side by side


def test_host_cost_of_moving_bytes_delays_compute():
    p = run(issued(0, 1_000), op(1_000_000), log.Waited((0,)), host=1e-4)
    assert p.host_comm_s == pytest.approx(0.1)
    assert p.step_s == pytest.approx(1.1)


def test_a_transfer_sharing_the_hosts_cores_slows_its_compute():
    # While the 1 s transfer moves, compute runs at half speed: 1 s of work takes 1.5 s.
    p = run(issued(0, 1_000_000), op(1_000_000), log.Waited((0,)), stolen=0.5)
    assert p.step_s == pytest.approx(1.5)
    assert p.host_comm_s == pytest.approx(0.5)
    assert sum(p.exposed.values()) == 0


def test_a_paced_gather_travels_as_its_slices_are_posted():
    p = run(issued(0, 0, paced=True), op(1_000_000), log.Posted(0, 400_000), op(1_000_000), log.Posted(0, 400_000),
            log.Waited((0,)))
    # Posted at 1 s and 2 s, 0.4 s each: lands at 2.4 s.
    assert p.step_s == pytest.approx(2.4)
    assert p.exposed == {"world": pytest.approx(0.4)}


def test_tflops_divide_the_models_flops_by_the_step():
    p = run(Op("mm", 2_000_000, 0, ("mm",), "forward"), Op("mm", 4_000_000, 0, ("mm",), "backward"),
            Op("mm", 2_000_000, 0, ("mm",), "backward"), Op("mm", 2_000_000, 0, ("mm",), "optimizer"))
    # Three times the forward: a recomputed forward (inside backward) and the optimizer are not the model's.
    assert p.model_flops == 6_000_000
    assert p.tflops == pytest.approx(6e6 / 10.0 / 1e12)


def test_a_ring_within_a_node_and_across_nodes():
    intra, inter = Link(100.0, 1e-6), Link(10.0, 5e-6)
    cluster = Cluster(intra, inter, Mesh(8, {"dp_shard": (8, 1), "world": (16, 1), "dp_outer": (2, 8)}))
    gather = log.Issued(0, "all_gather", 8_000_000_000, "dp_shard", 8)
    assert cluster.tier(gather) == "intra"
    assert cluster.wire_seconds(gather, gather.nbytes) == pytest.approx(7e-6 + 7 / 8 * 8.0 / 100)
    across = log.Issued(1, "all_gather", 8_000_000_000, "world", 16)
    assert cluster.tier(across) == "inter"
    assert cluster.wire_seconds(across, across.nbytes) == pytest.approx(15 * 5e-6 + 15 / 16 * 8.0 / 10)
    reduce = log.Issued(2, "all_reduce", 8_000_000_000, "dp_outer", 2)
    assert cluster.tier(reduce) == "inter"  # replicas 8 ranks apart: one a node
    assert cluster.wire_seconds(reduce, reduce.nbytes) == pytest.approx(5e-6 + 2 * 1 / 2 * 8.0 / 10)


def test_a_host_behind_one_shared_link_and_between_two_nodes():
    loopback = Link(1.0, 0.0)
    gather = log.Issued(0, "all_gather", 1_000_000_000, "world", 2)
    shared = Host(loopback, {"all_gather": 1e-9}, Mesh(2, {"world": (2, 1)}), shared_rate=250e6)
    # Both ranks send half the buffer through the one bucket: 1 GB at 250 MB/s.
    assert shared.wire_seconds(gather, gather.nbytes) == pytest.approx(4.0)
    # 0.5 GB sent at 1 ns of compute a byte, over the 4 s it moves: an eighth of the host's speed.
    assert shared.stolen(gather, gather.nbytes) == pytest.approx(0.125)
    assert shared.host_seconds(gather, gather.nbytes) == 0
    summing = Host(loopback, {}, Mesh(2, {"world": (2, 1)}), sum_s_per_byte=1e-9)
    reduce = log.Issued(3, "reduce_scatter", 1_000_000_000, "world", 2)
    assert summing.host_seconds(reduce, reduce.nbytes) == pytest.approx(0.5)
    nodes = Host(loopback, {}, Mesh(2, {"world": (4, 1), "dp_outer": (2, 2)}), node_rate=125e6)
    world = log.Issued(1, "all_gather", 1_000_000_000, "world", 4)
    # Each rank sends a quarter to each of 3 peers, 2 of them on the other node; 2 ranks share the egress.
    assert nodes.tier(world) == "inter"
    assert nodes.wire_seconds(world, world.nbytes) == pytest.approx(2 * 0.5e9 / 125e6)
    outer = log.Issued(2, "all_reduce", 1_000_000_000, "dp_outer", 2)
    assert nodes.wire_seconds(outer, outer.nbytes) == pytest.approx(2 * 1e9 / 125e6)


@pytest.fixture(scope="module")
def traced():
    """gpt-tiny, ZeRO-3 on 2 ranks and HSDP 2 x 2, each step recorded by the engine itself."""
    flat = estimate("gpt-tiny", [2], micro_batch=2, seq_len=64, trace=True)
    hsdp = estimate("gpt-tiny", [4], shard_size=2, micro_batch=2, seq_len=64, trace=True)
    return flat + hsdp


def test_the_schedule_is_the_engines_own(traced):
    (layout, figures), _ = traced
    records = figures.schedule.records
    issued_ = [r for r in records if isinstance(r, log.Issued)]
    # Every collective the account counted is in the schedule, with its bytes and dimension.
    by_kind: dict = {}
    for r in issued_:
        by_kind.setdefault(r.dim, {}).setdefault(r.kind, 0)
        by_kind[r.dim][r.kind] += r.nbytes
    assert by_kind == figures.comm
    # Each is waited for, after it was issued.
    issued_at = {r.ticket: i for i, r in enumerate(records) if isinstance(r, log.Issued)}
    waited_at = {t: i for i, r in enumerate(records) if isinstance(r, log.Waited) for t in r.tickets}
    assert set(waited_at) == set(issued_at)
    assert all(waited_at[t] > issued_at[t] for t in issued_at)
    # Forward prefetch: some gather is issued before the previous one is waited for,
    # with compute between its issue and its wait.
    overlapped = [t for t in issued_at if any(isinstance(r, Op) and r.flops
                                              for r in records[issued_at[t]:waited_at[t]])]
    assert len(overlapped) >= layout.world  # blocks' gathers ride behind the blocks before them
    # Each collective is known by the engine phase, and so the unit, that issued it.
    assert set(figures.schedule.issued_in) == set(issued_at)
    gathered = [where for t, where in figures.schedule.issued_in.items()
                if next(r for r in issued_ if r.ticket == t).kind == "all_gather"]
    assert gathered[0] == "flatfsdp::unshard (<root>)"
    assert {f"flatfsdp::unshard (blocks.{i})" for i in range(4)} <= set(gathered)


def test_hsdp_replica_reductions_follow_the_shard_reductions(traced):
    _, (layout, figures) = traced
    records = figures.schedule.records
    kinds = {r.ticket: (r.kind, r.dim) for r in records if isinstance(r, log.Issued)}
    follows = [r for r in records if isinstance(r, log.Follows)]
    assert follows
    for f in follows:
        assert {kinds[t] for t in f.tickets} == {("all_reduce", "dp_outer")}
        assert {kinds[t] for t in f.after} == {("reduce_scatter", "dp_shard")}


def test_rows_are_timed_and_the_pick_is_the_fastest_that_fits(traced):
    rows = list(traced)
    links = Links(ranks_per_node=2)
    predictions = time_rows(rows, lambda layout: Throughput(DEVICES["h100"]), links)
    for p in predictions:
        assert p.step_s >= p.compute_s > 0
        assert p.model_flops > 0
    assert mesh_dims(rows[1][0])["dp_outer"] == (2, 2)
    # The HSDP row crosses nodes (nodes of 2 ranks); the flat one stays on NVLink.
    assert set(predictions[0].busy) == {"intra"}
    assert set(predictions[1].busy) == {"intra", "inter"}
    picks = recommend(rows, predictions, None)
    assert picks == {2: 0, 4: 1}
    assert recommend(rows, predictions, 1) == {}


class TwoRates(Wire):
    """A link twice as slow while the host computes as while it waits (gloo's threads share the cores)."""

    def wire_seconds(self, record, nbytes: int, busy: bool = True) -> float:
        return nbytes * (2e-6 if busy else 1e-6)


def test_a_link_moves_at_the_rate_of_what_the_host_does():
    # 1 s of compute moves half of a 1 s (waiting) transfer; the other half takes 0.5 s of waiting.
    p = replay(StepTrace([issued(0, 1_000_000), op(1_000_000), log.Waited((0,))]), Clock(), TwoRates())
    assert p.step_s == pytest.approx(1.5)
    assert p.exposed == {"world": pytest.approx(0.5)}


def test_estimate_time_flags():
    from flatfsdp.cli.estimate_flags import DEVICE_NAMES, parse
    from flatfsdp.cli.flags import UsageError
    from flatfsdp.estimator.predict import parse_link

    assert sorted(DEVICE_NAMES) == sorted(DEVICES)  # kept without torch, beside the code that uses them
    args = parse(["--predict", "--device", "h200", "--inter-link", "2gbit", "--ranks-per-node", "4"])
    assert (args.predict, args.device, args.ranks_per_node) == (True, "h200", 4)
    assert parse_link(args.inter_link).gbytes_s == pytest.approx(0.25)
    assert parse_link("ib-400").name == "InfiniBand 400 Gbit/s"
    with pytest.raises(UsageError, match="--probe is what --predict computes with"):
        parse(["--probe"])
    with pytest.raises(ValueError, match="a preset"):
        parse_link("fast")


def test_a_probed_link_moves_at_its_waiting_rate_or_its_computing_rate():
    loopback = Link(100.0, 0.0)
    world = log.Issued(1, "all_gather", 1_000_000_000, "world", 4)
    nodes = Host(loopback, {}, Mesh(2, {"world": (4, 1)}), node_rate=100e6, link_rate_busy=50e6)
    # A node's egress carries 2 ranks x 2 of their 3 quarters = 1 GB of it.
    assert nodes.link_bytes(world, world.nbytes) == pytest.approx(1e9)
    assert nodes.wire_seconds(world, world.nbytes, busy=False) == pytest.approx(10.0)
    assert nodes.wire_seconds(world, world.nbytes, busy=True) == pytest.approx(20.0)
    inside = log.Issued(2, "all_gather", 1_000_000_000, "dp_shard", 2)
    assert Host(loopback, {}, Mesh(2, {"dp_shard": (2, 1)}), node_rate=100e6).link_bytes(inside, inside.nbytes) == 0
