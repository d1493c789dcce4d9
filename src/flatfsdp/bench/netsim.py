"""A throttled network on one host for the benchmark, made of Linux network
namespaces by the scripts shipped beside this module, in
``flatfsdp/bench/netsim_scripts`` (one_link.sh, two_nodes.sh, teardown.sh;
each says what it builds and why): package data, so an installed flatfsdp
has them as a source checkout does.

* ``--link RATE``: one namespace whose loopback carries at most RATE, both
  directions together; every rank runs inside it.
* ``--nodes 2 --link RATE``: two namespaces ("nodes") joined by a veth pair
  throttled to RATE each way; ranks of a node share its own, unthrottled loopback.

Both need root and iproute2's ``ip`` and ``tc``; without them the bench stops
before starting anything and names what is missing. The namespaces are named
after this process and removed when the run ends, however it ends (short of
SIGKILL; the scripts are idempotent and teardown.sh NAME clears leftovers).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

SCRIPTS = Path(__file__).resolve().parent / "netsim_scripts"
"""The scripts, package data of flatfsdp.bench (pyproject.toml's package-data)."""
MASTER_ADDRS = {1: "127.0.0.1", 2: "169.254.77.1"}
"""Where node 0's rank 0 listens: the namespace's loopback; node a's end of the wire (two_nodes.sh)."""
_SETUP_TIMEOUT_S = 60.0


def link_device(nodes: int) -> str:
    """The throttled interface inside each namespace (what gloo binds to, and whose counters are read)."""
    return "lo" if nodes == 1 else "wire"


def missing_for_link(euid: int, which: Callable[[str], str | None] = shutil.which,
                     scripts: Path = SCRIPTS) -> list[str]:
    """What this host lacks to build the throttled network; [] when nothing."""
    missing = []
    if euid != 0:
        missing.append(f"root privileges (effective uid is {euid}; network namespaces and tc need root)")
    missing += [f"the `{tool}` command ({pkg})" for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2"),
                                                                   ("bash", "bash")) if which(tool) is None]
    if not all((scripts / f"{name}.sh").is_file() for name in ("one_link", "two_nodes", "teardown")):
        missing.append(f"the netsim scripts one_link.sh, two_nodes.sh and teardown.sh in {scripts} (package "
                       "data of flatfsdp.bench; reinstall flatfsdp if they are gone)")
    return missing


def require_link_support(euid: int | None = None, which: Callable[[str], str | None] = shutil.which,
                         scripts: Path = SCRIPTS) -> None:
    """Refuse ``--link`` with one message naming everything missing (SystemExit, never a hang)."""
    missing = missing_for_link(os.geteuid() if euid is None else euid, which, scripts)
    if missing:
        raise SystemExit("--link needs " + "; ".join(missing) + ". Run without --link for plain loopback.")


class Network:
    """``with Network("2gbit", nodes=1) as net:`` the namespaces exist inside the block."""

    def __init__(self, rate: str, nodes: int, name: str | None = None, scripts: Path = SCRIPTS) -> None:
        if nodes not in MASTER_ADDRS:
            raise ValueError(f"{nodes} nodes: the simulated network has 1 or 2")
        self.rate, self.nodes, self.scripts = rate, nodes, scripts
        self.name = name or f"ffbench{os.getpid()}"
        self.device = link_device(nodes)
        self.master_addr = MASTER_ADDRS[nodes]

    @property
    def namespaces(self) -> list[str]:
        """Node i's namespace at index i."""
        return [self.name] if self.nodes == 1 else [f"{self.name}-a", f"{self.name}-b"]

    def node_command(self, node: int, argv: list[str]) -> list[str]:
        """``argv`` run as node ``node``: inside its namespace, gloo bound to the throttled device."""
        ip = shutil.which("ip") or "ip"
        return [ip, "netns", "exec", self.namespaces[node], "env", f"GLOO_SOCKET_IFNAME={self.device}", *argv]

    def __enter__(self) -> "Network":
        try:
            self._script("one_link" if self.nodes == 1 else "two_nodes", self.name, self.rate)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._script("teardown", self.name)

    def _script(self, name: str, *args: str) -> None:
        command = ["bash", str(self.scripts / f"{name}.sh"), *args]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=_SETUP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"{' '.join(command)} did not finish within {_SETUP_TIMEOUT_S:.0f} s") from None
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed (exit {done.returncode}): {done.stderr.strip()}")
