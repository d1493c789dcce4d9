"""The launcher never races for a port: the parent hosts the rendezvous store
on a port the kernel assigns as it binds, and the ranks join it as clients.
(A port probed free, released and handed to rank 0 to bind could be taken by
another launch in between: EADDRINUSE, now and then, with launches at once.)"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from flatfsdp.launch import launch


def _sum_of_ranks() -> tuple[int, float]:
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return int(os.environ["MASTER_PORT"]), float(value)


def test_many_launches_at_once_each_get_their_own_port_and_finish():
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda _: launch(_sum_of_ranks, 2, timeout_s=300), range(4)))
    assert [total for _, total in results] == [3.0] * 4  # each launch's two ranks met each other
    assert len({port for port, _ in results}) == 4
