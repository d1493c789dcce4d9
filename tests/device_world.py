"""What every device check shares: a world of one rank on the device under
test, the way a check says it cannot run here, and a small residual MLP.

Nothing here imports pytest: tools/gpu_check.sh runs the checks on machines
that may not have it (tests/run_device_checks.py).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


class Unavailable(Exception):
    """The check cannot run on this machine; the message says why (a skip, not a failure)."""


def default_device() -> torch.device:
    """The accelerator's current device where there is one, else the CPU."""
    if torch.accelerator.is_available():
        return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())
    return torch.device("cpu")


def require_cuda(device: torch.device, instead: str) -> None:
    """Refuse a CUDA-only check elsewhere, naming what covers it there."""
    if device.type != "cuda":
        raise Unavailable(f"CUDA only; on {device.type}: {instead}")


@contextlib.contextmanager
def world_of_one(device: torch.device, workdir: Path, mesh_device: str | None = None):
    """A default process group of one rank for the duration, and a 1-D mesh
    of ``mesh_device`` (default: ``device``'s type) over it.

    On an accelerator the group has two backends: the accelerator's own
    (NCCL on CUDA) for device tensors and gloo for host ones, so meshes of
    either kind can live in one process (a DCP checkpoint saved from one and
    loaded into the other). One GPU is one rank: NCCL refuses two ranks on a
    device, so what needs more ranks is checked with gloo on CPU instead."""
    from torch.distributed.device_mesh import init_device_mesh

    if device.type == "cpu":
        backend = "gloo"
    else:
        torch.accelerator.set_device_index(device.index or 0)
        backend = f"cpu:gloo,{device.type}:{dist.get_default_backend_for_device(device.type)}"
    store = dist.FileStore(str(workdir / "store"), 1)
    # A collective that never lands fails the check in two minutes instead of hanging the run.
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=120))
    try:
        yield init_device_mesh(mesh_device or device.type, (1,))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def chunk_kept_as_in_a_larger_group():
    """Groups built meanwhile keep a compute-dtype chunk and gather it over the
    backend, as every rank of a group of two or more does. At world 1 a ZeRO-3
    group otherwise holds its whole group (``GroupBuffers.holds_whole_group``)
    and nothing travels -- the default, checked as such -- so without this a
    one-GPU check would never issue the gathers, side streams and events a
    cluster runs on."""
    from unittest import mock

    from flatfsdp.engine.groups.buffers import GroupBuffers

    with mock.patch.object(GroupBuffers, "holds_whole_group", lambda self: False):
        yield


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


class Block(nn.Module):
    """A residual MLP block; bias-free Linears whose sizes are multiples of 16
    (float8 matmuls need that)."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width, bias=False)
        self.fc2 = nn.Linear(2 * width, width, bias=False)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def residual_mlp(width: int, depth: int, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net([Block(width) for _ in range(depth)])


def regression_data(width: int, rows: int, steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) per step, drawn on the CPU so every device sees the same numbers."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, width, generator=gen), torch.randn(rows, width, generator=gen)) for _ in range(steps)]


def main_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full fp32 copies, on the CPU, of the sharded parameters between steps --
    the main weights the optimizer steps (docs/contract.md) -- by name."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
            for name, p in model.named_parameters()}
