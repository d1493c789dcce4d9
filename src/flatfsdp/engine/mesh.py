"""Turn the user's mesh arguments into the 1-D data-parallel mesh and group the engine shards over."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from flatfsdp.engine.device import default_device_type


def resolve_dp_mesh(mesh: DeviceMesh | None = None, dp_shard_dim: str | None = None) -> DeviceMesh:
    """The 1-D mesh to shard over.

    ``mesh`` may be 1-D (used as is) or N-D with ``dp_shard_dim`` naming the
    dimension to shard over. With no mesh, a 1-D mesh over the default process
    group on the default device type.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flatfsdp needs torch.distributed initialised first "
                           "(torch.distributed.init_process_group, or run under torchrun)")
    if mesh is None:
        if dp_shard_dim is not None:
            raise ValueError(f"dp_shard_dim={dp_shard_dim!r} was given without a device_mesh")
        return init_device_mesh(default_device_type(), (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch.distributed.DeviceMesh, got {type(mesh).__name__}")
    if dp_shard_dim is None:
        if mesh.ndim != 1:
            raise ValueError(f"a {mesh.ndim}-D device_mesh (dims {mesh.mesh_dim_names}) needs dp_shard_dim "
                             "to say which dimension to shard over")
        return mesh
    names = mesh.mesh_dim_names or ()
    if dp_shard_dim not in names:
        raise ValueError(f"dp_shard_dim {dp_shard_dim!r} is not a dimension of the device mesh; "
                         f"its dimensions are {list(names)}")
    return mesh[dp_shard_dim]


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device tensors sharded over ``mesh`` live on, on this rank."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


def check_device(device, mesh: DeviceMesh) -> None:
    """Megatron-FSDP's ``device=``: the shards live where the mesh says, so a
    device that disagrees is an error rather than silently ignored."""
    if device is None:
        return
    wanted, actual = torch.device(device), mesh_device(mesh)
    if wanted.type != actual.type or (wanted.index is not None and wanted.index != actual.index):
        raise ValueError(f"device={str(device)!r} disagrees with the device mesh, whose shards live on "
                         f"{actual} on this rank: pass a mesh of that device type, or leave device= out")
