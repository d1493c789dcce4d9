"""A DTensor over a local tensor that stays where it is.

``DTensor.from_local`` moves a local tensor that is not on the mesh's device
type onto it (a copy). That is wrong for FSDP2's ``CPUOffloadPolicy``, where
the sharded main weights and their grads live in host memory while the mesh
is the accelerator's: the optimizer would step a device copy and the engine
would write gradients nobody reads (seen on the first lent GPU: offloaded
weights never moved). FSDP2 builds its sharded DTensors the same way, from a
spec, for the same reason.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement


def dtensor_over(local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], *,
                 shape: torch.Size, stride: tuple[int, ...]) -> DTensor:
    """``local`` -- this rank's part, used as is (same storage, same device) --
    as a DTensor of global ``shape`` and ``stride``. Not differentiable: for
    parameters, gradients and loaded values, none of which autograd tracks."""
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return DTensor(local, spec, requires_grad=False)
