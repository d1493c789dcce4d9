"""CPU offload (FSDP2's ``CPUOffloadPolicy``): a unit computes on the
accelerator while its sharded main weights, main gradients -- and so the
optimizer's state and step -- live in host memory.

What moves, per step: before a unit's first gather after an optimizer step,
its main weights go host -> device (cast into the compute-dtype chunk that is
all-gathered); each reduced gradient chunk comes device -> host once it lands.
Collectives never see host memory (NCCL cannot), so a host tensor that must
be broadcast or all-reduced goes through a device copy.

On a CPU mesh everything is in host memory already: offload then changes
nothing (``HostOffload.for_mesh`` returns None). A ``HostOffload`` handed to
the engine on CPU all the same builds the offloaded layout there -- separate
host buffers, every copy and staging made, CPU to CPU -- which is how its
logic is tested where no accelerator exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

HOST = torch.device("cpu")


@dataclass(frozen=True)
class HostOffload:
    pin_memory: bool = True
    """Page-locked host buffers: host <-> device copies run asynchronously and faster."""

    @staticmethod
    def for_mesh(policy: Any, device_type: str) -> "HostOffload | None":
        """The offload a ``CPUOffloadPolicy`` asks for on a mesh of ``device_type``."""
        from torch.distributed.fsdp import CPUOffloadPolicy

        if not isinstance(policy, CPUOffloadPolicy) or device_type == "cpu":
            return None
        return HostOffload(pin_memory=policy.pin_memory)

    def empty(self, numel: int, dtype: torch.dtype, compute_device: torch.device) -> torch.Tensor:
        pin = self.pin_memory and compute_device.type != "cpu"
        return torch.empty(numel, dtype=dtype, device=HOST, pin_memory=pin)


def staged_on_device(tensor: torch.Tensor, device: torch.device, collective: Callable[[torch.Tensor], None]) -> None:
    """Run an in-place ``collective`` on an offloaded group's host ``tensor``
    through a copy on ``device`` and back (NCCL takes device memory only)."""
    staged = tensor.to(device, copy=True)  # a copy even where device is the host (tests on CPU)
    collective(staged)
    tensor.copy_(staged)
