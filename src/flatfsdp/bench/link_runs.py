"""The alternating schedule behind a throttled link: each run starts torchrun
once per simulated node, inside that node's namespace, and reads back rank 0's
record (``link_rank``). Fresh processes per run, as on loopback (``runner``).

The floor has no communication in its timed steps, so the link could never
slow it: it runs on plain loopback with the same number of ranks, where the
report says so. The other contenders all run behind the link; with
``--link-penalty`` each also runs on loopback right after, so its link
penalty (behind / without) compares two runs of the same round.

A run never hangs the bench: when either node's torchrun fails the other is
stopped, and a run that outlives ``RUN_TIMEOUT_S`` is stopped too; each
failure carries the tail of both nodes' logs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from flatfsdp.bench.measure import run_contender
from flatfsdp.bench.netsim import Network, require_link_support
from flatfsdp.bench.options import BenchConfig
from flatfsdp.bench.run_records import RunRecords
from flatfsdp.bench.runner import run_all
from flatfsdp.launch import RankFailed, launch, under_torchrun

RUN_TIMEOUT_S = 1800.0
"""Longest one contender run may take behind the link before it is stopped."""
_BASE_PORT = 29600
"""Node 0's rendezvous port; each run takes the next (the namespaces are this
bench's own, so no other job competes for them; a fresh port per run keeps a
closing run's sockets out of the next one's way)."""
_POLL_S = 0.2
_GRACE_S = 5.0


def run_behind_link(cfg: BenchConfig, records: RunRecords) -> tuple[list[dict], dict[str, str]]:
    """``runner.run_all`` with every run behind the link ``cfg.link`` describes."""
    require_link_support()
    if under_torchrun():
        raise SystemExit("--link starts its own ranks inside network namespaces: run it without torchrun")
    with Network(cfg.link, cfg.nodes) as net, tempfile.TemporaryDirectory(prefix="flatfsdp-link-") as workdir:
        return run_all(cfg, run_one=LinkRuns(net, cfg, Path(workdir)), records=records)


class LinkRuns:
    """``run_one(cfg, name) -> record`` for ``run_all``."""

    def __init__(self, net: Network, cfg: BenchConfig, workdir: Path) -> None:
        self.net, self.workdir, self.runs = net, workdir, 0
        self.config = workdir / "config.json"
        self.config.write_text(json.dumps(cfg.as_dict()))

    def __call__(self, cfg: BenchConfig, name: str) -> dict:
        if name == "floor":
            return self.on_loopback(cfg, name)
        record = self.behind_link(cfg, name)
        if cfg.link_penalty:  # the same contender without the link, in the same round
            record["no_link"] = self.on_loopback(cfg, name)
        return record

    @staticmethod
    def on_loopback(cfg: BenchConfig, name: str) -> dict:
        """A run of the same ranks on plain loopback, unthrottled (one node)."""
        return launch(run_contender, cfg.nprocs * cfg.nodes, replace(cfg, link=None, nodes=1), name,
                      threads_per_rank=cfg.threads_per_rank)

    def behind_link(self, cfg: BenchConfig, name: str) -> dict:
        self.runs += 1
        out = self.workdir / f"run{self.runs}.json"
        logs = [self.workdir / f"run{self.runs}.node{node}.log" for node in range(cfg.nodes)]
        commands = [self.net.node_command(node, self._torchrun(cfg, node, name, out)) for node in range(cfg.nodes)]
        try:
            _run_nodes(commands, logs, RUN_TIMEOUT_S)
        except RankFailed as exc:
            errors = sorted(self.workdir.glob(f"{out.name}.rank*.err"))
            if errors:  # the ranks' own tracebacks say more than torchrun's summary
                raise RankFailed("".join(f"--- {e.name} ---\n{e.read_text()}" for e in errors)) from exc
            raise
        if not out.is_file():
            raise RankFailed(f"rank 0 wrote no record\n{_tails(logs)}")
        return json.loads(out.read_text())

    def _torchrun(self, cfg: BenchConfig, node: int, name: str, out: Path) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(cfg.nodes), "--node_rank", str(node),
                "--nproc_per_node", str(cfg.nprocs), "--master_addr", self.net.master_addr,
                "--master_port", str(_BASE_PORT + self.runs),
                "-m", "flatfsdp.bench.link_rank", str(self.config), name, str(out)]


def _run_nodes(commands: list[list[str]], logs: list[Path], timeout_s: float) -> None:
    """Run every node's command at once; return when all succeeded, else stop them all and raise."""
    procs = []
    try:
        for command, log in zip(commands, logs):
            with open(log, "w") as sink:
                # Its own session: stopping a node stops its torchrun and every rank under it.
                procs.append(subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                              start_new_session=True, env=os.environ.copy()))
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            if all(code == 0 for code in codes):
                return
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                raise RankFailed(f"node(s) {failed} exited with {[codes[i] for i in failed]}\n{_tails(logs)}")
            if time.monotonic() > deadline:
                raise RankFailed(f"the run did not finish within {timeout_s:.0f} s\n{_tails(logs)}")
            time.sleep(_POLL_S)
    finally:
        _stop(procs)


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM, then SIGKILL after a grace period, to each node's session we started."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + _GRACE_S
        for p in alive:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def _tails(logs: list[Path], lines: int = 30) -> str:
    parts = []
    for node, log in enumerate(logs):
        text = log.read_text(errors="replace").splitlines() if log.is_file() else []
        parts.append(f"--- node {node} ({log.name}) ---\n" + "\n".join(text[-lines:]))
    return "\n".join(parts)
