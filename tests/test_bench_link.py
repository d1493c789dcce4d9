"""The bench behind a throttled link (`--link RATE`, `--nnodes 2`): its options
and refusals, the wire-limit arithmetic on measured bytes, the engine's
account split into intra- and inter-node peers on a real 4-rank gloo run laid
out as 2 nodes of 2, and (as root) the namespaces and counters themselves.

No time is asserted; byte counts are deterministic and asserted exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from flatfsdp.bench.link_counters import LinkProbe, NodeLayout, split_sent
from flatfsdp.bench import netsim
from flatfsdp.bench.netsim import Network, missing_for_link, require_link_support
from flatfsdp.bench.options import BenchConfig, parse
from flatfsdp.bench.report import summarise
from flatfsdp.bench.wire import engine_directions, line_to_beat, parse_rate, wire_figures, wire_limit_s
from flatfsdp.bench.wire_table import wire_table
from flatfsdp.cli.flags import UsageError
from harness import run_ranks


def _cfg(*argv: str) -> BenchConfig:
    return parse(list(argv))[0]


# ---- options and refusals ------------------------------------------------------------------

def test_link_and_nodes_options():
    assert (_cfg().link, _cfg().nodes) == (None, 1)  # loopback as before
    cfg = _cfg("--link", "2gbit", "--nnodes", "2", "--nproc-per-node", "2", "--contenders", "flatfsdp-hsdp,fsdp2-hsdp")
    assert (cfg.link, cfg.nodes, cfg.contenders) == ("2gbit", 2, ("flatfsdp-hsdp", "fsdp2-hsdp"))
    # The ranks behind the link read the configuration back from JSON.
    assert BenchConfig.from_dict(json.loads(json.dumps(cfg.as_dict()))) == cfg
    with pytest.raises(UsageError, match="--nnodes 2 needs --link"):
        _cfg("--nnodes", "2")
    with pytest.raises(UsageError, match="tc's units"):
        _cfg("--link", "2000")  # tc reads a bare number as bits: refused, not guessed
    with pytest.raises(UsageError, match="invalid choice"):
        _cfg("--link", "1gbit", "--nnodes", "3")


def test_rates_in_tc_units():
    assert parse_rate("2gbit") == 250e6
    assert parse_rate("500mbit") == 62.5e6
    assert parse_rate("100mbps") == 100e6
    assert parse_rate("1gibit") == 2**30 / 8
    with pytest.raises(SystemExit):
        parse_rate("fast")


def test_refused_without_root_or_tools_naming_what_is_missing(tmp_path):
    with pytest.raises(SystemExit, match="root privileges .effective uid is 1000"):
        require_link_support(euid=1000)
    missing = missing_for_link(0, which=lambda tool: None if tool in ("ip", "tc") else "/bin/" + tool)
    assert missing == ["the `ip` command (iproute2)", "the `tc` command (iproute2)"]
    assert f"one_link.sh, two_nodes.sh and teardown.sh in {tmp_path}" in missing_for_link(0, scripts=tmp_path)[0]
    everything = missing_for_link(1000, which=lambda tool: None, scripts=tmp_path)
    assert len(everything) == 5  # root, ip, tc, bash, the scripts: all named at once


def test_the_scripts_ship_in_the_wheel_where_an_installed_bench_looks(tmp_path):
    """--link from an installed flatfsdp: the wheel holds the scripts beside
    bench/netsim.py, where SCRIPTS points (no source checkout needed)."""
    root = Path(__file__).resolve().parent.parent
    assert netsim.SCRIPTS == Path(netsim.__file__).resolve().parent / "netsim_scripts"
    assert missing_for_link(0, which=lambda tool: "/bin/" + tool) == []
    project = tmp_path / "project"
    shutil.copytree(root / "src", project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, project / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(project)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("flatfsdp-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for script in ("one_link", "two_nodes", "teardown"):
        assert f"flatfsdp/bench/netsim_scripts/{script}.sh" in names


# ---- the wire limit from measured bytes ----------------------------------------------------

def test_wire_limit_behind_one_link():
    # One link: every packet passes the loopback's one bucket; engine bytes are every message.
    link = dict(nodes=1, iface_tx=[402e6], iface_rx=[402e6], engine_intra=[400e6], engine_inter=[0.0],
                native_all_reduce={})
    assert engine_directions(link) == [400e6]
    row = wire_figures(2.0, link, parse_rate("2gbit"), floor_s=0.3)
    assert row["wire_s"] == pytest.approx(402e6 / 250e6) and row["engine_wire_s"] == pytest.approx(1.6)
    assert row["line_s"] == row["wire_s"] and row["step_vs_line"] == pytest.approx(2.0 / 1.608)
    # Compute-bound: the floor is the line.
    assert wire_figures(4.0, link, 250e6, floor_s=3.2)["line_s"] == 3.2
    # The floor itself ran on loopback: its own time is its line.
    assert wire_figures(0.3, None, 250e6, floor_s=0.3) == dict(behind_link=False, line_s=0.3, step_vs_line=1.0)


def test_wire_limit_between_two_nodes_is_the_busier_direction():
    link = dict(nodes=2, iface_tx=[100e6, 150e6], iface_rx=[150e6, 100e6], engine_intra=[9e6, 9e6],
                engine_inter=[95e6, 140e6], native_all_reduce={"dp_outer": 1e6})
    assert wire_limit_s(link["iface_tx"], parse_rate("1gbit")) == pytest.approx(1.2)
    assert engine_directions(link) == [95e6, 140e6]  # intra-node bytes never cross
    row = wire_figures(3.0, link, 125e6, floor_s=1.0)
    assert (row["wire_s"], row["engine_wire_s"], row["line_s"]) == pytest.approx((1.2, 1.12, 1.2))
    assert line_to_beat(None, 1.2) == 1.2
    summary = {"rows": {"flatfsdp-hsdp": dict(label="flatfsdp HSDP", step_s=3.0, link=link, wire=row)}}
    table = wire_table(BenchConfig(link="1gbit", nodes=2), summary)
    assert "| flatfsdp HSDP | 3.000 | 95.4 / 143.1 | 90.6 / 133.5 | 17.2 / 224.1 | 1.0 over dp_outer | 1.200 | " \
           "1.120 | 1.200 | 2.50 x |" in table


def test_link_penalty_compares_each_contender_with_its_own_run_without_the_link():
    with pytest.raises(UsageError, match="--link-penalty needs --link"):
        _cfg("--link-penalty")
    cfg = _cfg("--link", "2gbit", "--link-penalty", "--contenders", "flatfsdp", "--repeats", "2")
    link = dict(nodes=1, iface_tx=[250e6], iface_rx=[250e6], engine_intra=[249e6], engine_inter=[0.0],
                native_all_reduce={})

    def run(behind: list[float], without: list[float]) -> dict:
        plain = dict(contender="flatfsdp", step_times=without, exposed={"total": 0.01})
        return dict(contender="flatfsdp", n_params=10, world=2, stage=3, step_times=behind, losses=[1.0],
                    peak_bytes=[1, 1], memory_method="test", torch_bytes=None, engine_bytes=None, link=link,
                    exposed={"total": 0.05}, no_link=plain)

    summary = summarise(cfg, [run([2.2, 2.2, 2.3], [2.0, 2.1, 2.0]), run([2.1, 2.2, 2.2], [2.0, 2.0, 2.0])], {})
    row = summary["rows"]["flatfsdp"]
    assert row["no_link_step_s"] == pytest.approx(2.0) and row["no_link_range"] == [2.0, 2.0]
    assert row["link_penalty"] == pytest.approx(2.2 / 2.0) == row["wire"]["penalty"]
    assert row["wire"]["penalty_vs_wire"] == pytest.approx(2.2 / 2.0)  # the wire limit (1.0 s) is below the step
    assert wire_figures(2.2, link, 100e6, None, 2.0)["penalty_vs_wire"] == pytest.approx(2.2 / 2.5)
    table = wire_table(cfg, summary)
    assert "| flatfsdp | 2.200 | 2.000 (2.000-2.000) | 1.100 x | 1.100 x | 0.050 / 0.010 |" in table


# ---- the engine's account, split by node, on real ranks ------------------------------------

class _Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def _one_step(model) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 64)).pow(2).mean().backward()
    opt.step()


def split_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import flatfsdp

    # Two "nodes" of two ranks, as torchrun would tell each rank.
    os.environ.update(LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2))
    layout = NodeLayout.from_env(rank, world)
    out = {}
    for name, outer in (("fsdp", None), ("hsdp", "no_shard"), ("hfsdp", "optim")):
        torch.manual_seed(0)
        model = nn.Sequential(*(_Block(64) for _ in range(3)))
        mesh = {}
        if outer is not None:
            mesh = dict(device_mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard")),
                        dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", outer_dp_sharding_strategy=outer)
        model = flatfsdp.fully_shard(model, fsdp_unit_modules=[_Block], **mesh)
        account = flatfsdp.comm_account()
        _one_step(model)  # lazy initialisation behind us
        account.reset()
        dist.barrier()
        probe = LinkProbe("lo", layout, account, torch.device("cpu"))  # the host's lo: only the engine's side is exact
        _one_step(model)
        out[name] = dict(peers=account.sent_by_peer(), split=split_sent(account.sent_by_peer(), layout),
                         by_dim=account.by_dim(), link=probe.finish(steps=1))
    return out


def _p2p_bytes(by_dim: dict, dim: str) -> int:
    """Buffer bytes of the gathers and reduce-scatters over ``dim`` (pairwise exchanges on gloo)."""
    return sum(v["bytes"] for kind, v in by_dim.get(dim, {}).items() if kind != "all_reduce")


def test_engine_account_splits_intra_and_inter_node_bytes_exactly():
    results = run_ranks(split_worker, 4, timeout=300)
    for rank, out in enumerate(results):
        node_peer = rank ^ 1  # the other rank of this node
        # FSDP over all 4: each exchange of a B-byte buffer sends B/4 to every peer; one peer shares the node.
        fsdp = out["fsdp"]
        quarter = _p2p_bytes(fsdp["by_dim"], "world") // 4
        assert fsdp["peers"] == {peer: quarter for peer in range(4) if peer != rank}
        assert fsdp["split"] == (quarter, 2 * quarter)
        # HSDP, outer = node dimension: the shard exchanges stay on the node; only gloo's
        # all-reduce over dp_outer crosses, and the engine cannot see its per-peer bytes.
        hsdp = out["hsdp"]
        assert hsdp["peers"] == {node_peer: _p2p_bytes(hsdp["by_dim"], "dp_shard") // 2}
        assert hsdp["split"][1] == 0 and hsdp["by_dim"]["dp_outer"]["all_reduce"]["bytes"] > 0
        # HFSDP: the outer reduce-scatter and all-gather are exchanges too, with the other node's rank.
        hfsdp = out["hfsdp"]
        assert hfsdp["split"] == (_p2p_bytes(hfsdp["by_dim"], "dp_shard") // 2,
                                  _p2p_bytes(hfsdp["by_dim"], "dp_outer") // 2)
        assert hfsdp["split"][1] > 0
    # The probe sums each node's ranks: per node, what its two ranks sent each way.
    link = results[0]["fsdp"]["link"]
    assert link["nodes"] == 2 and link["engine_inter"] == [2 * r["fsdp"]["split"][1] for r in results[::2]]
    assert results[0]["hsdp"]["link"]["native_all_reduce"] == {
        "dp_outer": results[0]["hsdp"]["by_dim"]["dp_outer"]["all_reduce"]["bytes"]}


# ---- the namespaces themselves (root only) -------------------------------------------------

_needs_root = pytest.mark.skipif(bool(missing_for_link(os.geteuid())), reason="needs root, ip and tc")

_SEND = ("import socket, sys; s = socket.create_connection(('169.254.77.2', 29999), timeout=20); "
         "s.sendall(b'x' * int(sys.argv[1])); s.close()")
_RECV = ("import socket; l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
         "l.bind(('169.254.77.2', 29999)); l.listen(); print('ready', flush=True); c, _ = l.accept(); "
         "n = 0\nwhile (d := c.recv(1 << 20)): n += len(d)\nprint(n)")


def _counter(net: Network, node: int, name: str) -> int:
    return int(subprocess.check_output(net.node_command(node, ["cat", f"/sys/class/net/wire/statistics/{name}"])))


@_needs_root
def test_two_nodes_counters_see_what_crosses_and_teardown_leaves_nothing():
    nbytes = 8 << 20
    name = f"fftest{os.getpid()}"
    with Network("1gbit", nodes=2, name=name) as net:
        assert {f"{name}-a", f"{name}-b"} <= set(subprocess.check_output(["ip", "netns", "list"], text=True).split())
        before = _counter(net, 0, "tx_bytes")
        server = subprocess.Popen(net.node_command(1, [sys.executable, "-c", _RECV]), stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "ready"
            subprocess.run(net.node_command(0, [sys.executable, "-c", _SEND, str(nbytes)]), check=True, timeout=60)
            assert int(server.stdout.readline()) == nbytes
        finally:
            server.kill()
            server.wait()
        crossed = _counter(net, 0, "tx_bytes") - before
        # Payload plus TCP/IP headers of 1500-byte frames: a few percent, never less than the payload.
        assert nbytes < crossed < 1.08 * nbytes
        assert _counter(net, 1, "rx_bytes") >= nbytes
    assert not {f"{name}-a", f"{name}-b"} & set(subprocess.check_output(["ip", "netns", "list"], text=True).split())


@_needs_root
def test_one_link_throttles_the_namespace_loopback():
    with Network("2gbit", nodes=1, name=f"fftest{os.getpid()}") as net:
        qdisc = subprocess.check_output(net.node_command(0, [shutil.which("tc"), "qdisc", "show", "dev", "lo"]),
                                        text=True)
        assert "tbf" in qdisc and "rate 2Gbit" in qdisc
    assert net.name not in subprocess.check_output(["ip", "netns", "list"], text=True)


def test_a_failing_node_stops_the_other_and_a_slow_run_is_cut_off(tmp_path):
    from flatfsdp.bench.link_runs import _run_nodes
    from flatfsdp.launch import RankFailed

    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    stuck = [sys.executable, "-c", "import time; time.sleep(60)"]
    failing = [sys.executable, "-c", "raise SystemExit('node 1 gives up')"]
    with pytest.raises(RankFailed, match=r"(?s)node\(s\) \[1\] exited with \[1\].*node 1 gives up"):
        _run_nodes([stuck, failing], logs, timeout_s=60)
    with pytest.raises(RankFailed, match="did not finish within 1 s"):
        _run_nodes([stuck], logs[:1], timeout_s=1)


def test_the_cells_report_holds_each_prediction_to_ten_percent():
    from flatfsdp.bench.cells import PENALTY, PREDICTED
    from flatfsdp.bench.cells_report import penalty_rows, predicted_rows, write_report

    # Every cell the issue lists, each a valid bench command line.
    names = {c.name for c in PREDICTED}
    assert {"loopback-small-1", "loopback-small-2", "loopback-small-4", "2gbit-large-int8w-bf16g",
            "2nodes-1gbit-small"} <= names
    for cell in PREDICTED + PENALTY:
        parse(list(cell.argv))
    row = dict(label="flatfsdp", step_s=1.0, step_s_range=[0.9, 1.1], exposed_s=0.2, prediction_error=0.08,
               host_cpu_s=[0.7, 0.1], predicted=dict(step_s=1.08, exposed={"link": 0.15}, compute_s=0.6,
                                                     host_comm_s=0.12))
    far = dict(row, prediction_error=-0.2, host_cpu_s=None,
               predicted=dict(step_s=0.8, exposed={}, compute_s=0.5, host_comm_s=0.0))
    penalty = dict(label="FSDP2", step_s=2.2, no_link_step_s=2.0,
                   wire=dict(wire_s=1.0, penalty=1.1, penalty_vs_wire=1.1))
    results = {"cell": dict(summary=dict(rows={"flatfsdp": row, "fsdp2": penalty, "other": far}),
                            load=[[1.0, 0, 0], [2.0, 0, 0]])}
    assert predicted_rows(results) == [
        "| cell | flatfsdp | 1.000 (0.900-1.100) | 1.080 | +8.0% | yes | -- | 0.600 / 0.700; 0.120 / 0.100 "
        "| 0.150 / 0.200 | 1.00 -> 2.00 |",
        "| cell | flatfsdp | 1.000 (0.900-1.100) | 0.800 | -20.0% | **no** | -- | 0.500 / --; 0.000 / -- "
        "| 0.000 / 0.200 | 1.00 -> 2.00 |"]
    # Beside a floor predicted 20% high in the same cell, +8% is the machine's drift less 10% of the model's.
    floor = dict(row, label="floor", prediction_error=0.2, exposed_s=None)
    results["cell"]["summary"]["rows"]["floor"] = floor
    assert predicted_rows(results)[0].split(" | ")[6:9] == ["-10.0%", "0.600 / 0.700; 0.120 / 0.100", "0.150 / 0.200"]
    assert predicted_rows(results)[2].split(" | ")[6] == "--"
    assert penalty_rows(results) == ["| cell | FSDP2 | 2.200 | 2.000 | 1.000 | 1.100 x | 1.100 x | 1.00 -> 2.00 |"]
