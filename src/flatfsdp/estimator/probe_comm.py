"""What moving bytes between ranks costs on this host (the probe's second
half, probe.py): rates and the compute it takes away, measured with every
rank doing the same at once, as training does.

The engine's gloo gathers and reductions are pairwise exchanges: every send
and receive to every peer posted at once (engine/comm/exchange.py), a
reduction then summing what arrived on the host. Those are timed here as
point-to-point messages, and gloo's all-reduce as itself:

* waiting: nothing else runs -- the rate a transfer reaches while the ranks
  wait for it, and the CPU the rank spent on it (every thread's, kernel time
  included: ``getrusage``), per byte sent. Where ranks fill the cores, that
  CPU is compute lost: the workload below takes about that much longer
  beside a transfer (about 0.55 ns a byte sent, either way, on the 2-core
  host, 2026-11-27), but the CPU count is the steadier figure;
* computing: the transfer posted, then a fixed matmul workload runs while a
  thread notes when the transfer landed -- the rate while the ranks compute.
"""

from __future__ import annotations

import resource
import statistics
import threading
import time

import torch
import torch.distributed as dist

_REPEATS = 5


def measure(nbytes: int, device: torch.device, workload_s: float = 0.5) -> dict:
    """Rates (GB/s a rank sends), latency and compute lost per byte sent, by
    kind; ``workload_s``: how long the compute beside a transfer lasts."""
    world, me = dist.get_world_size(), dist.get_rank()
    flat = torch.ones(nbytes // 4, device=device)
    chunk = flat.numel() // world
    peers = [p for p in range(world) if p != me]
    inbox = {p: torch.empty(chunk, device=device) for p in peers}
    mine = flat[me * chunk:(me + 1) * chunk].clone()

    def exchange() -> list:
        return ([dist.isend(flat[p * chunk:(p + 1) * chunk], p) for p in peers]
                + [dist.irecv(inbox[p], p) for p in peers])

    def all_reduce() -> list:
        return [dist.all_reduce(flat, async_op=True)]

    sent = {"exchange": chunk * 4 * len(peers), "all_reduce": 2 * (world - 1) * nbytes / world}
    workload = _workload(device, workload_s)
    out = dict(waiting_gbytes_s={}, computing_gbytes_s={}, lost_s_per_byte={}, workload_lost_s_per_byte={})
    for kind, post in (("exchange", exchange), ("all_reduce", all_reduce)):
        _wait(post())  # connections made, buffers touched
        waiting = [_timed_wait(post) for _ in range(_REPEATS)]
        loaded = [_while_computing(post, workload) for _ in range(_REPEATS)]
        out["waiting_gbytes_s"][kind] = sent[kind] / statistics.median(t for t, _ in waiting) / 1e9
        out["lost_s_per_byte"][kind] = statistics.median(cpu for _, cpu in waiting) / sent[kind]
        out["computing_gbytes_s"][kind] = sent[kind] / statistics.median(t for t, _ in loaded) / 1e9
        out["workload_lost_s_per_byte"][kind] = max(0.0, statistics.median(x for _, x in loaded)) / sent[kind]
    start = time.perf_counter()
    for p in peers:
        mine.add_(inbox[p])  # a reduce-scatter's sum, on the host's main thread
    out["sum_s_per_byte"] = (time.perf_counter() - start) / sent["exchange"]
    out["latency_s"] = _latency(peers, device)
    return out


def _workload(device: torch.device, seconds: float):
    """A compute loop of about ``seconds`` here: the time it takes alone is measured each time."""
    a, b = torch.randn(384, 1536, device=device), torch.randn(1536, 384, device=device)
    start = time.perf_counter()
    for _ in range(4):
        a @ b
    reps = max(8, int(seconds / max(1e-6, (time.perf_counter() - start) / 4)))

    def run() -> float:
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        return time.perf_counter() - start
    return run


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _timed_wait(post) -> tuple[float, float]:
    """(seconds, CPU seconds of this rank: every thread, kernel time included)."""
    dist.barrier()
    start, cpu = time.perf_counter(), _cpu_s()
    _wait(post())
    return time.perf_counter() - start, _cpu_s() - cpu


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _while_computing(post, workload) -> tuple[float, float]:
    """(seconds until the transfer landed, seconds the workload took beyond its time alone)."""
    dist.barrier()
    alone = workload()
    dist.barrier()
    start, landed = time.perf_counter(), []
    works = post()
    waiter = threading.Thread(target=lambda: (_wait(works), landed.append(time.perf_counter() - start)))
    waiter.start()
    took = workload()
    waiter.join()
    return landed[0], took - alone


def _latency(peers: list[int], device: torch.device) -> float:
    small = torch.ones(1024, device=device)
    inbox = torch.empty_like(small)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(20):
        _wait([dist.isend(small, p) for p in peers] + [dist.irecv(inbox, p) for p in peers])
    return (time.perf_counter() - start) / 20
