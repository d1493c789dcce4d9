"""Where a param group's buffers live: the sharding strategy, resolved once.

A strategy says which *kinds* of state are sharded; a group turns it into the
placement of each of its buffers (sharded over the data-parallel mesh, or
replicated; kept between steps, or allocated around each use). After this
nothing asks the strategy: buffers know their placement, and every DTensor the
group hands out carries the placement that describes its local tensor.

A parameter that cannot be sharded (a scalar; a block-aligned parameter no
dimension splits in whole blocks) lives in a replicated group whatever the
strategy: DDP-style, its gradients all-reduced.

With HSDP the chunks are split over the ``shard`` mesh and repeated on every
``outer`` replica: DTensors are placed ``(Replicate(), Shard(d))`` on the 2-D
mesh, as FSDP2 places them. A tensor-parallel parameter keeps its own
placements after the data-parallel ones (see ``TensorParallelSpec``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from flatfsdp.engine.layout.arithmetic import ParamLayout
from flatfsdp.engine.layout.mesh import DataParallelMesh, combined_mesh, spans_data_parallel
from flatfsdp.engine.layout.strategy import ShardingStrategy


@dataclass(frozen=True)
class TensorParallelSpec:
    """A parameter that arrived as a DTensor (tensor / sequence / expert
    parallel): flatfsdp shards its local tensor and hands the module a DTensor
    of the same mesh and placements around each use."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    """The global shape."""
    data_parallel_dims: tuple[int, ...] = ()
    """FSDP2's ``dp_mesh_dims``: ``mesh`` is the whole SPMD mesh, and these of
    its dimensions (replicated here) are the data-parallel ones flatfsdp shards
    over. The sharded DTensor stays on ``mesh``, sharded on those dimensions."""

    def shards_dim(self, dim: int) -> int:
        """How many ranks of this mesh split tensor dimension ``dim`` (1: none)."""
        ways = 1
        for index, (size, placement) in enumerate(zip(self.mesh.shape, self.placements)):
            if index in self.data_parallel_dims:
                continue
            if isinstance(placement, Shard) and placement.dim == dim:
                ways *= size
        return ways


@dataclass(frozen=True)
class GroupPlacement:
    dp: DataParallelMesh
    sharded: bool
    """Main weights, optimizer state and reduced gradients are chunked over the
    shard mesh (``Shard``); False: every rank holds them whole (``Replicate``)."""
    keep_model_weights: bool
    """The full (unsharded) model weights stay allocated between uses; False:
    gathered before each use and released after (ZeRO-3)."""
    keep_grad_buffer: bool
    """The unsharded gradient accumulation buffer stays allocated between steps;
    False: allocated from a unit's backward to its reduction (ZeRO-2/3)."""
    tp_mesh: DeviceMesh | None = None
    """The tensor-parallel mesh every parameter of the group is a DTensor on (None: plain tensors)."""
    hybrid: bool = False
    """HFSDP: main weights, main grads and optimizer state are sharded across
    the outer dimension as well (see groups/replicas.py)."""

    @classmethod
    def resolve(cls, strategy: ShardingStrategy, dp: DataParallelMesh, *, replicate: bool = False,
                tp_mesh: DeviceMesh | None = None, hybrid: bool = False) -> "GroupPlacement":
        if replicate or strategy == ShardingStrategy.NO_SHARD:
            return cls(dp, sharded=False, keep_model_weights=True, keep_grad_buffer=True, tp_mesh=tp_mesh)
        return cls(dp, sharded=True,
                   keep_model_weights=strategy < ShardingStrategy.OPTIM_GRADS_PARAMS,
                   keep_grad_buffer=strategy < ShardingStrategy.OPTIM_GRADS, tp_mesh=tp_mesh,
                   hybrid=hybrid and dp.hybrid_spmd is not None)

    @property
    def mesh(self) -> DeviceMesh:
        """The mesh chunks are split over (and reduce-scattered over)."""
        return self.dp.shard

    @property
    def world(self) -> int:
        """Ranks a parameter is chunked over (1 when replicated)."""
        return self.dp.shard.size() if self.sharded else 1

    def dtensor_mesh(self, fqn: str) -> DeviceMesh:
        """The mesh of the sharded parameters' DTensors."""
        if self.hybrid:
            return self.dp.hybrid_spmd
        if self.tp_mesh is None:
            return self.dp.spmd
        if spans_data_parallel(self.tp_mesh, self.dp):
            return self.tp_mesh
        return combined_mesh(self.dp.spmd, self.tp_mesh, fqn)

    def dtensor_placements(self, param: ParamLayout, tp: TensorParallelSpec | None = None) -> tuple[Placement, ...]:
        """The DTensor placement of a parameter's (and its gradient's and optimizer
        state's) local chunk: one per data-parallel dimension, then the
        tensor-parallel ones. Where tensor parallelism already splits the
        dimension chunked here, the chunk is of the local shard: ``_StridedShard``."""
        if self.hybrid:
            return Shard(0), Shard(0)  # inner chunk i, then its o-th piece, on (shard, outer): see groups/replicas.py
        outer = (Replicate(),) if self.dp.outer is not None else ()
        if param.shard_dim is None:
            dp: Placement = Replicate()
        elif tp is not None and tp.shards_dim(param.shard_dim) > 1:
            dp = _StridedShard(param.shard_dim, split_factor=tp.shards_dim(param.shard_dim))
        else:
            dp = Shard(param.shard_dim)
        if tp is not None and tp.data_parallel_dims:  # the SPMD mesh: its own dimension order
            placements = list(tp.placements)
            for index, placement in zip(tp.data_parallel_dims, outer + (dp,)):
                placements[index] = placement
            return tuple(placements)
        return outer + (dp,) + (tp.placements if tp is not None else ())
