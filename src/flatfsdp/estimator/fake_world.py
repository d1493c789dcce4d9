"""One rank of a world that does not exist: torch's fake process group (every
collective returns at once, moving nothing) and fake tensors (shapes, dtypes
and storages with no memory behind them). The engine runs in it unchanged --
the same layout, padding, buffers and collectives as in training -- so what
it allocates and sends can be counted for any world size on one machine.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode


@contextlib.contextmanager
def fake_world(world: int) -> Iterator[FakeTensorMode]:
    """Be rank 0 of ``world`` ranks until the block ends; tensors made inside
    the yielded mode are fake. Needs a process with no process group yet."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the estimator needs a process without a process group: it builds a fake one of each "
                           "world size it is asked about (run it outside torchrun / launch)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield FakeTensorMode()
    finally:
        dist.destroy_process_group()
