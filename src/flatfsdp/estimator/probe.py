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
* communication (ranks side by side): point-to-point exchanges of a large
  buffer, as the engine's gloo gathers and reductions move bytes, and
  gloo's all-reduce: wall time and the CPU the rank spent; a small exchange
  for the latency.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from flatfsdp.estimator.compute_cost import OpRates
from flatfsdp.estimator.op_timer import OpTimer, dispatch_seconds, rates_from


@dataclass
class MachineProbe:
    alone: OpRates
    """The model's ops with one rank on the machine."""
    side_by_side: OpRates
    """The same with ``ranks`` ranks computing at once."""
    ranks: int
    cores: int
    step_s: dict[str, float] = field(default_factory=dict)
    """The probe's own unsharded step, unobserved: "alone", "side_by_side"."""
    loopback_gbytes_s: float = 0.0
    """Bytes a rank sends per second in an exchange (nothing else running)."""
    latency_s: float = 0.0
    """A small exchange's time."""
    cpu_s_per_byte: dict[str, float] = field(default_factory=dict)
    """Host CPU per byte a rank sends, by collective kind."""
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """The host's load average when the probe ran (others' jobs perturb it)."""

    def to_json(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("alone", "side_by_side")}
        return dict(out, alone=_rates_json(self.alone), side_by_side=_rates_json(self.side_by_side))

    @classmethod
    def from_json(cls, data: dict) -> "MachineProbe":
        rates = {k: _rates_from_json(data[k]) for k in ("alone", "side_by_side")}
        rest = {k: v for k, v in data.items() if k not in rates}
        return cls(**rates, **{**rest, "load": tuple(rest.get("load", (0, 0, 0)))})


def probe(step_factory: Callable, factory_args: tuple, *, ranks: int | None = None, steps: int = 3,
          comm_mbytes: int = 64, threads_per_rank: int = 1) -> MachineProbe:
    """Probe this machine for the model ``step_factory(*factory_args)`` trains
    (it returns a function making one training step; module-level, so ranks can
    import it). ``ranks``: side by side (default: one per core)."""
    from flatfsdp.launch import launch

    cores = os.cpu_count() or 1
    ranks = ranks or cores
    load = os.getloadavg()
    alone = launch(probe_rank, 1, step_factory, factory_args, steps, 0, threads_per_rank=threads_per_rank)
    together = launch(probe_rank, ranks, step_factory, factory_args, steps, comm_mbytes,
                      threads_per_rank=threads_per_rank)
    return MachineProbe(alone=alone["rates"], side_by_side=together["rates"], ranks=ranks, cores=cores,
                        step_s={"alone": alone["step_s"], "side_by_side": together["step_s"]},
                        loopback_gbytes_s=together["gbytes_s"], latency_s=together["latency_s"],
                        cpu_s_per_byte=together["cpu_s_per_byte"], load=load)


def probe_rank(step_factory: Callable, factory_args: tuple, steps: int, comm_mbytes: int) -> dict:
    """One probe rank (what ``probe`` launches)."""
    device = torch.device(torch.accelerator.current_accelerator().type) if torch.accelerator.is_available() \
        else torch.device("cpu")
    step = step_factory(*factory_args)
    for _ in range(2):
        step()
    dist.barrier()
    plain = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        _sync(device)
        plain.append(time.perf_counter() - start)
    dist.barrier()
    timer = OpTimer(device)
    with timer:
        step()
    step_s = statistics.median(plain)
    out = dict(rates=rates_from(timer.timed, step_s, dispatch_seconds(device)), step_s=step_s)
    if dist.get_world_size() > 1 and comm_mbytes:
        out.update(_comm(comm_mbytes << 20, device))
    return out


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this rank: gloo's too
    return usage.ru_utime + usage.ru_stime


def _comm(nbytes: int, device: torch.device) -> dict:
    """Exchanges of an ``nbytes`` buffer between every pair, as the engine's gloo
    gathers post them (every send and receive at once), and reduce-scatters
    (the same, plus summing what arrived); gloo's all-reduce."""
    world, me = dist.get_world_size(), dist.get_rank()
    flat = torch.ones(nbytes // 4, device=device)
    chunk = flat.numel() // world
    peers = [p for p in range(world) if p != me]
    inbox = {p: torch.empty(chunk, device=device) for p in peers}

    def exchange(sum_into: torch.Tensor | None) -> None:
        works = [dist.isend(flat[p * chunk:(p + 1) * chunk], p) for p in peers]
        works += [dist.irecv(inbox[p], p) for p in peers]
        for w in works:
            w.wait()
        if sum_into is not None:
            for p in peers:
                sum_into.add_(inbox[p])

    mine = flat[me * chunk:(me + 1) * chunk].clone()
    kinds = {"all_gather": lambda: exchange(None), "reduce_scatter": lambda: exchange(mine),
             "all_reduce": lambda: dist.all_reduce(flat)}
    sent = {"all_gather": chunk * 4 * len(peers), "reduce_scatter": chunk * 4 * len(peers),
            "all_reduce": 2 * (world - 1) * nbytes / world}
    walls, cpus = {}, {}
    for kind, run in kinds.items():
        run()  # connections made, buffers touched
        timed = []
        for _ in range(3):
            dist.barrier()
            wall, cpu = time.perf_counter(), _cpu_s()
            run()
            timed.append((time.perf_counter() - wall, _cpu_s() - cpu))
        walls[kind], cpus[kind] = statistics.median(t for t, _ in timed), statistics.median(c for _, c in timed)
    small = torch.ones(1024, device=device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(20):
        works = [dist.isend(small, p) for p in peers] + [dist.irecv(torch.empty_like(small), p) for p in peers]
        for w in works:
            w.wait()
    latency = (time.perf_counter() - start) / 20
    return dict(gbytes_s=sent["all_gather"] / max(1e-9, walls["all_gather"] - latency) / 1e9, latency_s=latency,
                cpu_s_per_byte={k: cpus[k] / sent[k] for k in kinds}, walls=walls)


def _rates_json(rates: OpRates) -> dict:
    return dict(rates.__dict__, by_key=[[_listed(k), v] for k, v in rates.by_key.items()])


def _rates_from_json(data: dict) -> OpRates:
    return OpRates(**{**data, "by_key": {_tupled(k): v for k, v in data["by_key"]}})


def _listed(value):
    return [_listed(v) for v in value] if isinstance(value, tuple) else value


def _tupled(value):
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value
