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
    (see offload.py for what offloading does, and why a CPU mesh needs none)."""
    if policy is None:
        return
    from torch.distributed.fsdp import OffloadPolicy

    if not isinstance(policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be a torch.distributed.fsdp.OffloadPolicy, got {type(policy).__name__}")


def dims_from_dp_mesh_dims(dp_mesh_dims: Any, dp_shard_dim: str | None,
                           dp_outer_dim: str | None) -> tuple[str | None, str | None]:
    """FSDP2's ``dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...)``
    (torch 2.12+: which dimensions of a full SPMD mesh are data-parallel) as
    this engine's ``(dp_shard_dim, dp_outer_dim)``."""
    if dp_mesh_dims is None:
        return dp_shard_dim, dp_outer_dim
    if dp_shard_dim is not None or dp_outer_dim is not None:
        raise ValueError("pass the data-parallel dimensions either as dp_mesh_dims= or as dp_shard_dim=/dp_outer_dim=, "
                         "not both")
    shard, replicate = getattr(dp_mesh_dims, "shard", None), getattr(dp_mesh_dims, "replicate", None)
    if shard is None:
        raise NotImplementedError(f"dp_mesh_dims={dp_mesh_dims!r}: replication without a shard dimension is "
                                  "not supported by flatfsdp's fully_shard; name a shard dimension")
    for role, names in (("shard", shard), ("replicate", replicate)):
        if isinstance(names, (tuple, list)) and len(names) > 1:
            raise NotImplementedError(f"dp_mesh_dims {role}={tuple(names)!r}: several dimensions are flattened by "
                                      f"torch here; flatten them yourself (mesh[{tuple(names)!r}]._flatten(name)) "
                                      "and name the flattened dimension")
    def single(names):
        return names[0] if isinstance(names, (tuple, list)) else names
    return single(shard), single(replicate)
