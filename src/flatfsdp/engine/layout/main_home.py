"""Where a group's main weights and main grads live -- the device, or host
memory (FSDP2's ``CPUOffloadPolicy``) -- chosen once per group, as its
placement is: ``DEVICE`` or a ``HostHome``. Below the choice nothing asks
which; the home allocates them, stages collectives on them, takes delivered
gradients in and says whether they may share memory with device buffers.

In host memory a unit computes on the accelerator while its sharded main
weights, main grads -- and so the optimizer's state and step -- stay on the
host. What moves, per step: before a unit's first gather after an optimizer
step, its main weights go host -> device (cast into the compute-dtype chunk
that is all-gathered); each reduced gradient chunk comes device -> host once
it lands. Collectives never see host memory (NCCL cannot), so a host tensor
that must be broadcast or all-reduced goes through a device copy.

On a CPU mesh everything is in host memory already: the policy then changes
nothing (``HostHome.for_policy`` returns ``DEVICE``). A ``HostHome`` handed to the
engine on CPU all the same builds the host layout there -- separate host
buffers, every copy and staging made, CPU to CPU -- which is how its logic
is tested where no accelerator exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from flatfsdp.engine.layout.block_formats import BlockFormat
from flatfsdp.engine.layout.buffer import FlatBuffer

HOST = torch.device("cpu")


@dataclass(frozen=True)
class DeviceHome:
    """Main weights and grads beside what the device computes with."""

    shares_device_memory = True
    """Main weights and grads may alias the model weights and gradient buffers."""
    keyword = ""

    def empty(self, numel: int, dtype: torch.dtype, compute_device: torch.device) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=compute_device)

    def main_grads(self, numel: int, dtype: torch.dtype, compute_device: torch.device
                   ) -> tuple[torch.Tensor, FlatBuffer | None]:
        """(the main grads, zeroed; the buffer whose storage is released
        between steps once the optimizer has dropped them -- see
        GroupGradients.release_consumed)."""
        buffer = FlatBuffer(numel, dtype, compute_device, name="main grads")
        return buffer.data.zero_(), buffer

    def in_place_collective(self, tensor: torch.Tensor, compute_device: torch.device,
                            collective: Callable[[torch.Tensor], None]) -> None:
        collective(tensor)

    def take(self, result: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
        """A reduced gradient chunk, where the main grads are."""
        return result

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def check_weight_codes(self, fmt: BlockFormat | None, name: str) -> None:
        """Block-scaled gathers encode the main weights where they are: on the device, fine."""


DEVICE = DeviceHome()


@dataclass(frozen=True)
class HostHome:
    """Main weights and grads in host memory (FSDP2's ``CPUOffloadPolicy``)."""

    pin_memory: bool = True
    """Page-locked host buffers: host <-> device copies run asynchronously and faster."""
    shares_device_memory = False
    """Host main weights never alias what the device computes with."""
    keyword = "offload_policy=CPUOffloadPolicy"
    """What the user asked for, as errors name it."""

    def empty(self, numel: int, dtype: torch.dtype, compute_device: torch.device) -> torch.Tensor:
        pin = self.pin_memory and compute_device.type != "cpu"
        return torch.empty(numel, dtype=dtype, device=HOST, pin_memory=pin)

    def main_grads(self, numel: int, dtype: torch.dtype, compute_device: torch.device
                   ) -> tuple[torch.Tensor, FlatBuffer | None]:
        # Host memory is what this home spends instead: kept, not released between steps.
        return self.empty(numel, dtype, compute_device).zero_(), None

    def in_place_collective(self, tensor: torch.Tensor, compute_device: torch.device,
                            collective: Callable[[torch.Tensor], None]) -> None:
        """Through a copy on the device and back (NCCL takes device memory only)."""
        staged = tensor.to(compute_device, copy=True)  # a copy even where the device is the host (tests on CPU)
        collective(staged)
        tensor.copy_(staged)

    def take(self, result: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
        return result.to(main_grad.device)  # device -> host, once per reduction

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    @staticmethod
    def for_policy(policy: Any, device_type: str) -> "MainHome":
        """The home an FSDP2 ``offload_policy`` asks for on a mesh of ``device_type``."""
        from torch.distributed.fsdp import CPUOffloadPolicy

        if not isinstance(policy, CPUOffloadPolicy) or device_type == "cpu":
            return DEVICE
        return HostHome(pin_memory=policy.pin_memory)

    def check_weight_codes(self, fmt: BlockFormat | None, name: str) -> None:
        if fmt is not None:
            raise NotImplementedError(f"param_gather_dtype={fmt.name!r} with {self.keyword} (parameter "
                                      f"'{name}'): block-scaled gathers read the main weights on the device")


MainHome = DeviceHome | HostHome
