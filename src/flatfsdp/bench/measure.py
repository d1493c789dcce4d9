"""One contender run on one rank: what every launched rank executes.

Order matters for fairness: imports and batches come before the memory
baseline; the warm-up's last step is the one whose collectives are counted at
the torch layer (the counting dispatch mode slows what it watches, so it never
runs while the clock does); the clock covers only the timed steps, each ended
by a device synchronisation.
"""

from __future__ import annotations

import gc
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from flatfsdp.bench.comm_bytes import CollectiveBytes
from flatfsdp.bench.contenders import REGISTRY, Trainer
from flatfsdp.bench.host_cpu import HostCpu
from flatfsdp.bench.link_activity import activity
from flatfsdp.bench.link_counters import LinkProbe, NodeLayout
from flatfsdp.bench.link_sampler import LinkSampler
from flatfsdp.bench.memory import PeakMemory
from flatfsdp.bench.netsim import link_device
from flatfsdp.bench.options import BenchConfig
from flatfsdp.bench.wire import parse_rate
from flatfsdp.bench.workload import build_model, device, make_batches, param_count


def _sync(dev: torch.device) -> None:
    if dev.type != "cpu":
        torch.accelerator.synchronize()


def _warm_up(trainer: Trainer, batches: list, warmup: int) -> tuple[list[float], dict | None]:
    losses, counted = [], None
    for i in range(warmup):
        if i == warmup - 1:
            with CollectiveBytes() as counter:
                losses.append(trainer.step(*batches[i]).item())
            counted = counter.snapshot()
        else:
            losses.append(trainer.step(*batches[i]).item())
    return losses, counted


def _timed(trainer: Trainer, batches: list, dev: torch.device, cpu: HostCpu) -> tuple[list[float], list[float]]:
    times, losses = [], []
    for x, y in batches:
        cpu.start()
        trainer.marks.note("step")
        start = time.perf_counter()
        loss = trainer.step(x, y)
        _sync(dev)
        times.append(time.perf_counter() - start)
        cpu.stop()
        losses.append(loss.item())
    trainer.marks.note("end")
    return times, losses


def _timed_with_timeline(cfg: BenchConfig, trainer: Trainer, batches: list, dev: torch.device,
                         cpu: HostCpu) -> tuple[list[float], list[float], dict | None]:
    """``_timed``; with ``--link-timeline`` behind a link, rank 0 also samples
    the link's counter and marks the phases of each step (link_activity.py)."""
    if not (cfg.link_timeline and cfg.link):
        return (*_timed(trainer, batches, dev, cpu), None)
    with tempfile.TemporaryDirectory(prefix="flatfsdp-timeline-") as workdir:
        sampler = LinkSampler(link_device(cfg.nodes), Path(workdir) / "samples.txt") if dist.get_rank() == 0 else None
        if sampler is not None:
            sampler.start()
            trainer.marks.on = True
        dist.barrier()  # the sampler runs before any rank's first timed step
        try:
            times, losses = _timed(trainer, batches, dev, cpu)
        finally:
            trainer.marks.on = False
            counter = sampler.stop() if sampler is not None else None
    timeline = None if counter is None else activity(counter, trainer.marks.marks, parse_rate(cfg.link))
    return times, losses, timeline


def _per_step_engine_bytes(account, steps: int) -> dict | None:
    if account is None:
        return None
    snap = account.snapshot()
    # Every step moves the same collectives, so the division is exact; a
    # fraction here would itself be a finding worth seeing.
    def per_step(n: int) -> int | float:
        return n // steps if n % steps == 0 else n / steps
    return {kind: {"count": per_step(v["count"]), "bytes": per_step(v["bytes"])} for kind, v in snap.items()}


def _exposed_per_step(account, steps: int, dev: torch.device) -> dict | None:
    """Seconds per timed step the host waited for collectives (the engine's
    account: communication not hidden behind compute), by kind; the slowest
    rank's total under "total"."""
    if account is None or not hasattr(account, "waited"):
        return None
    mine = {kind: s / steps for kind, s in account.waited().items()}
    total = torch.tensor([sum(mine.values())], dtype=torch.float64, device=dev)
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    return dict(mine, total=total.item())


def run_contender(cfg: BenchConfig, name: str) -> dict:
    """Train ``cfg.warmup + cfg.steps`` steps under contender ``name``; gather every rank's figures."""
    # FSDP2 calls collectives torch itself marks deprecated: one warning per call is noise here.
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed", category=FutureWarning)
    contender = REGISTRY[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = device()
    contender.preload()
    batches = make_batches(cfg, rank, world, dev)
    gc.collect()
    dist.barrier()
    probe = PeakMemory(dev)
    # Built where it trains: a 1.2B model's init on one CPU thread and a 5 GB
    # copy would cost every run seconds; the seed makes it the same model for
    # every contender on this device.
    with torch.device(dev):
        model = build_model(cfg)
    n_params = param_count(model)
    trainer = contender.setup(model, cfg)
    del model  # the trainer holds what it needs
    warm_losses, torch_bytes = _warm_up(trainer, batches, cfg.warmup)
    if trainer.account is not None:
        trainer.account.reset()
    dist.barrier()
    # Behind a throttled link: its byte counters around the timed steps, and
    # which peers share this rank's node (only there, so a loopback run keeps
    # its schedule to the barrier).
    link = None
    if cfg.link:
        link = LinkProbe(link_device(cfg.nodes), NodeLayout.from_env(rank, world), trainer.account, dev)
    cpu = HostCpu()
    times, losses, timeline = _timed_with_timeline(cfg, trainer, batches[cfg.warmup:], dev, cpu)
    link_bytes = link.finish(cfg.steps) if link else None
    engine_bytes = _per_step_engine_bytes(trainer.account, cfg.steps)
    exposed = _exposed_per_step(trainer.account, cfg.steps, dev)
    peak = probe.peak_bytes()
    return _gather(dict(
        contender=name, n_params=n_params, world=world, stage=trainer.stage, device=str(dev),
        memory_method=probe.method, torch_bytes=torch_bytes, engine_bytes=engine_bytes, link=link_bytes,
        exposed=exposed, host_cpu_s=_host_cpu_by_rank(cpu.medians(), dev), link_timeline=timeline,
    ), times, warm_losses + losses, peak, dev)


def _host_cpu_by_rank(mine: list[float] | None, dev: torch.device) -> list[list[float]] | None:
    """Each rank's ``[main thread, other threads]`` CPU seconds, indexed by rank
    (one all-reduce); None unless every rank measured them."""
    world, rank = dist.get_world_size(), dist.get_rank()
    table = torch.zeros(world, 3, dtype=torch.float64, device=dev)
    if mine is not None:
        table[rank] = torch.tensor([*mine, 1.0], dtype=torch.float64, device=dev)
    dist.all_reduce(table)
    if table[:, 2].sum().item() < world:
        return None
    return table[:, :2].tolist()


def _gather(record: dict, times: list[float], losses: list[float], peak: int, dev: torch.device) -> dict:
    """Combine ranks after the clock stopped: a step lasts as long as its slowest
    rank; a loss is the mean over ranks (the global batch's loss); memory is kept per rank."""
    world = dist.get_world_size()
    t = torch.tensor(times, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    loss = torch.tensor(losses, dtype=torch.float64, device=dev)
    dist.all_reduce(loss)
    peaks = torch.zeros(world, dtype=torch.float64, device=dev)
    peaks[dist.get_rank()] = peak
    dist.all_reduce(peaks)
    record.update(step_times=t.tolist(), losses=(loss / world).tolist(), peak_bytes=[int(p) for p in peaks.tolist()])
    return record
