"""FSDP2's own arguments, checked and turned into the engine's terms: the
mesh it accepts, ``reshard_after_forward`` as an int, ``offload_policy``."""

from __future__ import annotations

from typing import Any

from torch.distributed.device_mesh import DeviceMesh


class MeshError(ValueError, AssertionError):
    """A mesh fully_shard cannot use. (Also an AssertionError: FSDP2 raises one
    for an unnamed 2-D mesh, and code written for it catches that.)"""


def check_fsdp2_mesh(mesh: DeviceMesh | None) -> None:
    """``mesh=`` as FSDP2 takes it: 1-D (shard), or 2-D with named dimensions
    (replicate, shard) for hybrid sharding."""
    if mesh is None or not isinstance(mesh, DeviceMesh):
        return
    if mesh.ndim > 2:
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh} ({mesh.ndim}-D): "
                         "pass the data-parallel part of it, e.g. mesh['dp']")
    if mesh.ndim == 2 and not mesh.mesh_dim_names:
        raise MeshError("Please init the 2D mesh for HSDP with mesh_dim_names specified "
                        f"(got {mesh} without names), e.g. init_device_mesh(..., mesh_dim_names=('replicate', "
                        "'shard'))")


def fsdp2_reshard_after_forward(value: bool | int | None, mesh: DeviceMesh) -> bool | None:
    """FSDP2 also takes an int: the number of ranks to keep the weights sharded
    over between forward and backward. 1 keeps them whole (as False); any
    other divisor of the mesh size releases them (as True: this engine keeps
    no partially gathered copy, so the backward gathers from the shards)."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ValueError(f"reshard_after_forward must be a bool, an int or None, got {type(value).__name__}")
    world = mesh.size()
    if value < 1 or world % value:
        raise ValueError(f"reshard_after_forward={value} must be a positive divisor of the mesh size ({world})")
    return value != 1


def check_offload_policy(policy: Any) -> None:
    """``OffloadPolicy()`` (no offload) and ``CPUOffloadPolicy`` are accepted
    (see layout/main_home.py for what host memory changes, and why a CPU mesh needs none)."""
    if policy is None:
        return
    from torch.distributed.fsdp import OffloadPolicy

    if not isinstance(policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be a torch.distributed.fsdp.OffloadPolicy, got {type(policy).__name__}")

