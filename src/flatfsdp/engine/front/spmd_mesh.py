"""FSDP2's ``dp_mesh_dims``: the mesh is the whole SPMD mesh, every parameter
is a DTensor on it, replicated on the data-parallel dimensions the argument
names, and ``fully_shard`` shards over those dimensions only.

Read here as the engine's own arguments -- ``dp_shard_dim`` / ``dp_outer_dim``
on that mesh -- after checking what FSDP2 checks. The engine's tensor-parallel
path does the rest: it sees that a parameter's mesh spans the data-parallel
dimensions (``layout.mesh.data_parallel_dims``), keeps the module's view a
DTensor on the whole mesh as FSDP2 does, and places the sharded parameter on
that mesh with the data-parallel dimensions' placements replaced.

Several names for one role (FSDP2 flattens them into one dimension) are not
supported yet and are refused, naming them.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from flatfsdp.engine.runtime.fsdp_module import FSDPModule


def spmd_dp_dims(mesh: DeviceMesh | None, dp_mesh_dims: Any) -> tuple[str | None, str | None]:
    """(shard dimension, replicate dimension) named by ``dp_mesh_dims``."""
    if mesh is None or not isinstance(mesh, DeviceMesh) or not mesh.mesh_dim_names:
        raise ValueError("dp_mesh_dims needs mesh= to be the whole SPMD DeviceMesh with named dimensions")
    roles = {}
    for role in ("shard", "replicate"):
        value = getattr(dp_mesh_dims, role, None)
        names = () if value is None else (value,) if isinstance(value, str) else tuple(value)
        if len(names) > 1:
            raise NotImplementedError(f"dp_mesh_dims.{role}={names}: flattening several mesh dimensions into one "
                                      "is not supported yet; flatten them on the mesh and name the result")
        unknown = [n for n in names if n not in mesh.mesh_dim_names]
        if unknown:
            raise ValueError(f"dp_mesh_dims.{role}: {unknown[0]!r} is not a dimension of the mesh; its dimensions "
                             f"are {list(mesh.mesh_dim_names)}")
        roles[role] = names[0] if names else None
    if roles["shard"] is None and roles["replicate"] is None:
        raise ValueError("dp_mesh_dims names no dimension: set shard= and/or replicate=")
    return roles["shard"], roles["replicate"]


def check_spmd_params(module: nn.Module | list[nn.Module], mesh: DeviceMesh) -> None:
    """Every parameter not yet sharded is a DTensor on ``mesh`` (as FSDP2 requires)."""
    for root in module if isinstance(module, (list, tuple)) else [module]:
        for owner_name, owner in _not_yet_sharded(root):
            for name, param in owner.named_parameters(recurse=False):
                fqn = f"{owner_name}.{name}" if owner_name else name
                if not isinstance(param, DTensor):
                    raise ValueError(f"dp_mesh_dims: parameter '{fqn}' is a plain tensor; with dp_mesh_dims every "
                                     f"parameter must be a DTensor on the whole mesh {list(mesh.mesh_dim_names)} "
                                     "(e.g. through distribute_module)")
                if param.device_mesh != mesh:
                    raise ValueError(f"dp_mesh_dims: parameter '{fqn}' is a DTensor on {param.device_mesh}, not on "
                                     f"the mesh passed to fully_shard {mesh}")


def _not_yet_sharded(root: nn.Module, prefix: str = ""):
    """``root`` and its submodules, short of units sharded before (FSDP2 shards bottom-up)."""
    yield prefix, root
    for name, child in root.named_children():
        if not isinstance(child, FSDPModule):
            yield from _not_yet_sharded(child, f"{prefix}.{name}" if prefix else name)
