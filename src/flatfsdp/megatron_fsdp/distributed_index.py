"""``FSDPDistributedIndex``: the meshes and process groups a ``MegatronFSDP``
is sharded over (megatron_fsdp keeps it in ``utils``, which re-exports it
from here).

The index checks at construction that what it is given agrees: the named
dimensions exist in the mesh (a dimension flattened with ``_flatten`` -- NeMo
AutoModel shards over ``dp_cp`` when context parallelism is on -- counts, as
in stock), and each group given beside the mesh
(``hybrid_fsdp_group``, ``fsdp_group_ag``) holds exactly the ranks the mesh
says -- one error naming the group and both rank lists, before anything is
sharded.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from flatfsdp.engine import DistributedIndexGroups, sub_mesh


class FSDPDistributedIndex(DistributedIndexGroups):
    """megatron_fsdp 0.6.1's constructor; the groups are the mesh's."""

    def __init__(self, device_mesh: DeviceMesh, dp_shard_dim: str | None = None, dp_outer_dim: str | None = None,
                 tp_dim: str | None = None, hybrid_fsdp_group: dist.ProcessGroup | None = None,
                 hybrid_fsdp_expt_group: dist.ProcessGroup | None = None, hsdp_outer_dp_shard: bool = False,
                 expt_device_mesh: DeviceMesh | None = None, fsdp_group_ag: dist.ProcessGroup | None = None,
                 expt_fsdp_group_ag: dist.ProcessGroup | None = None):
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(f"FSDPDistributedIndex: device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
        for role, dim in (("dp_shard_dim", dp_shard_dim), ("dp_outer_dim", dp_outer_dim), ("tp_dim", tp_dim)):
            if dim is not None:
                sub_mesh(device_mesh, dim, f"FSDPDistributedIndex: {role}")  # names the dimension if it is not there
        if dp_shard_dim is None:
            raise ValueError("FSDPDistributedIndex needs dp_shard_dim: the mesh dimension parameters are sharded over")
        self.device_mesh, self.dp_shard_dim, self.dp_outer_dim, self.tp_dim = device_mesh, dp_shard_dim, dp_outer_dim, tp_dim
        self.use_hybrid_fsdp = dp_outer_dim is not None
        self.hsdp_outer_dp_shard = bool(hsdp_outer_dp_shard)
        self.expt_device_mesh = expt_device_mesh
        self.fsdp_group = sub_mesh(device_mesh, dp_shard_dim, "dp_shard_dim").get_group()
        self.outer_fsdp_group = sub_mesh(device_mesh, dp_outer_dim, "dp_outer_dim").get_group() \
            if self.use_hybrid_fsdp else None
        self.hybrid_fsdp_group = hybrid_fsdp_group
        self.hybrid_fsdp_expt_group = hybrid_fsdp_expt_group
        self.fsdp_group_ag, self.expt_fsdp_group_ag = fsdp_group_ag, expt_fsdp_group_ag
        expert_names = tuple(expt_device_mesh.mesh_dim_names or ()) if expt_device_mesh is not None else ()
        self.expt_fsdp_group = expt_device_mesh[dp_shard_dim].get_group() if dp_shard_dim in expert_names else None
        self.expt_outer_fsdp_group = (expt_device_mesh[dp_outer_dim].get_group()
                                      if dp_outer_dim in expert_names else None)
        _check_group_ranks("fsdp_group_ag", fsdp_group_ag, _mesh_ranks(device_mesh, (dp_shard_dim,)), dp_shard_dim)
        if self.use_hybrid_fsdp:
            _check_group_ranks("hybrid_fsdp_group", hybrid_fsdp_group,
                               _mesh_ranks(device_mesh, (dp_outer_dim, dp_shard_dim)), f"{dp_outer_dim} x {dp_shard_dim}")
        elif hybrid_fsdp_group is not None:
            raise ValueError("FSDPDistributedIndex: hybrid_fsdp_group is given but dp_outer_dim is not: the hybrid "
                             "group is the ranks of dp_outer_dim x dp_shard_dim")


def _mesh_ranks(mesh: DeviceMesh, dims: tuple[str, ...]) -> list[int]:
    """The global ranks of this rank's sub-mesh over ``dims``."""
    sub = sub_mesh(mesh, dims if len(dims) > 1 else dims[0], "/".join(dims))
    return sorted(sub.mesh.flatten().tolist())


def _check_group_ranks(role: str, group: Any, expected: list[int], dims: str) -> None:
    if group is None:
        return
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"FSDPDistributedIndex: {role} must be a torch.distributed.ProcessGroup, "
                        f"got {type(group).__name__}")
    ranks = sorted(dist.get_process_group_ranks(group))
    if ranks != expected:
        raise ValueError(f"FSDPDistributedIndex: {role} holds ranks {ranks}, but the device mesh's {dims} "
                         f"holds {expected} for rank {dist.get_rank()}: the group disagrees with the mesh")
