"""The engine's environment switches, read once, where a model is sharded.

Every ``FLATFSDP_*`` variable the engine honours is read here and nowhere
else, into one frozen record that the sharded model carries (in its
``ShardOptions``): a variable changed after ``fully_shard`` does not change
a running model half way through a step, and a bad value is refused at
``fully_shard``, naming the variable, not at some later collective.

``Transport`` is the part collectives need (how gloo moves bytes, how long
a wait may take); it travels with each group's wire codecs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

TIMEOUT_ENV = "FLATFSDP_TIMEOUT"
GLOO_ALGORITHM_ENV = "FLATFSDP_GLOO_ALGORITHM"
CHECK_VALUES_ENV = "FLATFSDP_CHECK_REPLICAS"
SCHEDULE_ENV = "FLATFSDP_CHECK_SCHEDULE"
NONFINITE_ENV = "FLATFSDP_ON_NONFINITE"
MALLOC_TRIM_ENV = "FLATFSDP_MALLOC_TRIM"

GLOO_ALGORITHMS = ("exchange", "native", "all_reduce")
"""How gathers and reduce-scatters run on gloo: pairwise messages (Note
[gloo exchange] in comm/exchange.py), gloo's own collectives, or gradients
all-reduced with the local slice kept."""

NONFINITE_MODES = ("warn", "error", "off")
_VALUE_MODES = {"0": "skip", "off": "skip", "warn": "warn", "1": "error", "error": "error",
                "broadcast": "broadcast"}


@dataclass(frozen=True)
class Transport:
    """How collectives move bytes: chosen once, carried by every codec."""

    gloo_algorithm: str = "exchange"
    """One of GLOO_ALGORITHMS; other backends always run their own collectives."""
    timeout_s: float | None = None
    """``FLATFSDP_TIMEOUT``: the longest wait, if the user set one (comm/watchdog.py)."""

    def algorithm(self, backend: str) -> str:
        """"native" everywhere but gloo; on gloo the chosen algorithm."""
        return self.gloo_algorithm if backend == "gloo" else "native"


@dataclass(frozen=True)
class EngineSwitches:
    transport: Transport = field(default_factory=Transport)
    check_replicas: str | None = None
    """``FLATFSDP_CHECK_REPLICAS``: "error", "warn" or "skip" (None: each front door's default)."""
    check_schedule: bool = False
    """``FLATFSDP_CHECK_SCHEDULE=1``: compare the ranks' collective schedules every step."""
    on_nonfinite: str = "warn"
    """``FLATFSDP_ON_NONFINITE``: the default of ``set_on_nonfinite``."""
    malloc_trim: bool = False
    """``FLATFSDP_MALLOC_TRIM=1``: hand freed heap pages back each step (runtime/host_memory.py)."""

    @staticmethod
    def from_environment(env: Mapping[str, str] | None = None) -> "EngineSwitches":
        env = os.environ if env is None else env
        algorithm = env.get(GLOO_ALGORITHM_ENV, "exchange")
        if algorithm not in GLOO_ALGORITHMS:
            raise ValueError(f"{GLOO_ALGORITHM_ENV}={algorithm!r}: expected one of {', '.join(GLOO_ALGORITHMS)}")
        replicas = env.get(CHECK_VALUES_ENV, "").strip().lower()
        if replicas and replicas not in _VALUE_MODES:
            raise ValueError(f"{CHECK_VALUES_ENV}={replicas!r}: expected one of error, warn, broadcast, 0")
        nonfinite = env.get(NONFINITE_ENV, "warn")
        if nonfinite not in NONFINITE_MODES:
            raise ValueError(f"{NONFINITE_ENV}={nonfinite!r}: expected one of {', '.join(NONFINITE_MODES)}")
        return EngineSwitches(
            transport=Transport(algorithm, _timeout(env.get(TIMEOUT_ENV))),
            check_replicas=_VALUE_MODES[replicas] if replicas else None,
            check_schedule=env.get(SCHEDULE_ENV, "0") not in ("", "0"),
            on_nonfinite=nonfinite,
            malloc_trim=env.get(MALLOC_TRIM_ENV, "0") == "1")


def _timeout(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return value
