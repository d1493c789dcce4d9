"""A probe of the machine at hand: what a model's compute costs here, op by
op, and what moving bytes between ranks costs -- the inputs a prediction of
step time needs on a host that no published figure describes (a CPU shared
by ranks, gloo over loopback).

One probe serves every layout and world size of the same model and batch:
it measures the machine, never a sharded configuration. Its ranks are
launched fresh (``flatfsdp.launch``): one alone, then one per core side by
side (each rank computing on its share of the cores, as training runs them).

* compute: the unsharded model's training step (``step_factory``: forward,
  backward, optimizer), every op timed (op_timer.py);
* communication (ranks side by side): transfers as the engine's gloo
  gathers and reductions make them, while the ranks wait and while they
  compute (probe_comm.py).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.distributed as dist

from flatfsdp.estimator import probe_comm
from flatfsdp.estimator.compute_cost import OpRates
from flatfsdp.estimator.fabric import Link
from flatfsdp.estimator.op_timer import OpTimer, dispatch_seconds, rates_from


@dataclass
class MachineProbe:
    alone: OpRates
    """The model's ops with one rank on the machine."""
    side_by_side: OpRates
    """The same with ``ranks`` ranks computing at once."""
    ranks: int
    cores: int
    step_s: dict[str, list[float]] = field(default_factory=dict)
    """The probe's own unsharded steps, unobserved, one per workload: "alone", "side_by_side"."""
    loopback_gbytes_s: float = 0.0
    """GB a rank sends per second in an exchange while the ranks wait for it."""
    loopback_busy_gbytes_s: float = 0.0
    """The same while the ranks compute (gloo's threads share the cores)."""
    latency_s: float = 0.0
    """A small exchange's time."""
    cpu_s_per_byte: dict[str, float] = field(default_factory=dict)
    """Compute time a rank loses per byte it sends while computing beside the
    transfer, by collective kind."""
    sum_s_per_byte: float = 0.0
    """A reduce-scatter's sum of what arrived, per byte, on the main thread."""
    measured: dict = field(default_factory=dict)
    """probe_comm's raw figures."""
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """The host's load average when the probe ran (others' jobs perturb it)."""
    engine_step_s: dict[str, float] = field(default_factory=dict)
    """By workload: the step of the model sharded by the engine at one rank
    (nothing to communicate), timed: what the engine's host work beyond its
    ops (hooks, buffer allocations) costs is that minus its ops' time. The
    faster of ``engine_step_each_s``."""
    engine_step_each_s: dict[str, list[float]] = field(default_factory=dict)
    """The engine's step timed twice, in a fresh process at each end of the probe."""
    links: dict[str, dict] = field(default_factory=dict)
    """Throttled links probed on this machine (the bench's simulated ones), by
    ``bench.link_probe.link_key``: what each carried of the engine's exchanges,
    bytes/s while the ranks wait and while they compute, beside its nominal rate."""

    def to_json(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("alone", "side_by_side")}
        return dict(out, alone=_rates_json(self.alone), side_by_side=_rates_json(self.side_by_side))

    @classmethod
    def from_json(cls, data: dict) -> "MachineProbe":
        rates = {k: _rates_from_json(data[k]) for k in ("alone", "side_by_side")}
        rest = {k: v for k, v in data.items() if k not in rates}
        return cls(**rates, **{**rest, "load": tuple(rest.get("load", (0, 0, 0)))})


def loopback(machine: MachineProbe, computing: bool = False) -> Link:
    """The probed loopback, while the ranks wait (or compute)."""
    rate = machine.loopback_busy_gbytes_s if computing else machine.loopback_gbytes_s
    return Link(rate, machine.latency_s, "loopback" + (" (computing)" if computing else ""))


def probe(workloads: list[tuple[Callable, tuple]], *, ranks: int | None = None, steps: int = 3,
          comm_mbytes: int = 128, threads_per_rank: int = 1, workload_s: float = 0.5,
          engine_workloads: list[tuple[str, Callable, tuple]] = ()) -> MachineProbe:
    """Probe this machine for the training steps ``factory(*args)`` makes, for
    each ``(factory, args)`` of ``workloads`` (a factory returns a function making
    one step; module-level, so ranks can import it): the same model at several
    batch shapes, say. ``ranks``: side by side (default: one per core);
    ``comm_mbytes``, ``workload_s``: the buffer exchanged and the compute beside
    it (probe_comm.py); ``engine_workloads``: (name, factory, args) of the same
    steps through the engine, timed at one rank (``MachineProbe.engine_step_s``)."""
    from flatfsdp.launch import launch

    cores = os.cpu_count() or 1
    # On accelerators a rank is a device (ranks side by side on one GPU would
    # only share its memory); on a host, a core.
    ranks = ranks or (torch.accelerator.device_count() if torch.accelerator.is_available() else cores)
    load = os.getloadavg()
    alone = launch(probe_rank, 1, workloads, steps, 0, workload_s, threads_per_rank=threads_per_rank)

    def engine_steps() -> dict[str, float]:
        # Each engine workload in fresh processes, as a training run starts: a heap warmed by
        # another workload would hide the page faults of the engine's buffers.
        return {name: launch(probe_rank, 1, [], steps, 0, workload_s, [(name, factory, args)],
                             threads_per_rank=threads_per_rank)["engine_step_s"][name]
                for name, factory, args in engine_workloads}

    first = engine_steps()
    together = None
    if ranks > 1:
        together = launch(probe_rank, ranks, workloads, steps, comm_mbytes, workload_s,
                          threads_per_rank=threads_per_rank)
    # Timed again at the probe's other end, the faster kept: another job's load only ever adds
    # time, and one that caught three engine steps once put 0.5 s on a 3.0 s step (2026-11-28).
    second = engine_steps()
    each = {name: [first[name], second[name]] for name in first}
    engine = {name: min(times) for name, times in each.items()}
    if together is None:  # nothing side by side, nothing to exchange: one device
        return MachineProbe(alone=alone["rates"], side_by_side=alone["rates"], ranks=1, cores=cores,
                            step_s={"alone": alone["step_s"], "side_by_side": alone["step_s"]},
                            engine_step_s=engine, engine_step_each_s=each, load=load)
    return MachineProbe(alone=alone["rates"], side_by_side=together["rates"], ranks=ranks, cores=cores,
                        step_s={"alone": alone["step_s"], "side_by_side": together["step_s"]},
                        engine_step_s=engine, engine_step_each_s=each, load=load,
                        **{k: together[k] for k in ("loopback_gbytes_s", "loopback_busy_gbytes_s",
                                                               "latency_s", "cpu_s_per_byte", "sum_s_per_byte",
                                                               "measured")})


def probe_device() -> torch.device:
    """Where a probe times the model: the accelerator if there is one, else the
    CPU -- also the device whose ops the step is traced on (a model runs other
    ops on another device)."""
    return torch.device(torch.accelerator.current_accelerator().type) if torch.accelerator.is_available() \
        else torch.device("cpu")


def probe_rank(workloads: list[tuple[Callable, tuple]], steps: int, comm_mbytes: int, workload_s: float = 0.5,
               engine_workloads: list[tuple[str, Callable, tuple]] = ()) -> dict:
    """One probe rank (what ``probe`` launches)."""
    device = probe_device()
    per_op = dispatch_seconds(device)
    overlapped = OpTimer(device).overlapped
    timed, overheads, step_s = [], [], []
    for factory, args in workloads:
        workload_timed, plain = _time_steps(factory(*args), steps, device)
        timed += workload_timed
        step_s.append(plain)
        overheads.append(rates_from(workload_timed, plain, per_op, steps, overlapped).step_overhead_s)
    # Signatures carry shapes, so the workloads' ops stay apart; the model's own fixed cost is theirs on average.
    overhead = statistics.mean(overheads) if overheads else 0.0
    rates = replace(rates_from(timed, 0.0, per_op, steps, overlapped), step_overhead_s=overhead)
    out = dict(rates=rates, step_s=step_s, engine_step_s={})
    for name, factory, args in engine_workloads:
        out["engine_step_s"][name] = _plain_steps(factory(*args), steps, device)
    if dist.get_world_size() > 1 and comm_mbytes:
        out.update(_comm(comm_mbytes << 20, device, workload_s))
    return out


def _plain_steps(step: Callable[[], None], steps: int, device: torch.device) -> float:
    """The median of ``steps`` steps (after two untimed ones)."""
    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_steps(step: Callable[[], None], steps: int, device: torch.device) -> tuple[list, float]:
    """Every op of ``steps`` steps timed, and the median of as many plain steps
    between them: a load that drifts meanwhile (other jobs) weighs on both alike."""
    for _ in range(2):
        step()
    dist.barrier()
    plain, timer = [], OpTimer(device)
    for _ in range(steps):
        start = time.perf_counter()
        step()
        _sync(device)
        plain.append(time.perf_counter() - start)
        with timer:
            step()
    return timer.timed, statistics.median(plain)


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def _comm(nbytes: int, device: torch.device, workload_s: float) -> dict:
    """The engine's kinds of collective, from the transfers probe_comm measures."""
    m = probe_comm.measure(nbytes, device, workload_s)
    lost = m["lost_s_per_byte"]
    return dict(loopback_gbytes_s=m["waiting_gbytes_s"]["exchange"],
                loopback_busy_gbytes_s=m["computing_gbytes_s"]["exchange"], latency_s=m["latency_s"],
                cpu_s_per_byte={"all_gather": lost["exchange"], "reduce_scatter": lost["exchange"],
                                "all_reduce": lost["all_reduce"]}, sum_s_per_byte=m["sum_s_per_byte"],
                measured=m)


def _rates_json(rates: OpRates) -> dict:
    return dict(rates.__dict__, by_key=[[_listed(k), v] for k, v in rates.by_key.items()])


def _rates_from_json(data: dict) -> OpRates:
    return OpRates(**{**data, "by_key": {_tupled(k): v for k, v in data["by_key"]}})


def _listed(value):
    return [_listed(v) for v in value] if isinstance(value, tuple) else value


def _tupled(value):
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value
