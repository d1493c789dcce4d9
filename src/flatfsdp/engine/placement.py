"""Where a param group's buffers live: the sharding strategy, resolved once.

A strategy says which *kinds* of state are sharded; a group turns it into the
placement of each of its buffers (sharded over the data-parallel mesh, or
replicated; kept between steps, or allocated around each use). After this
nothing asks the strategy: buffers know their placement, and every DTensor the
group hands out carries the placement that describes its local tensor.

A parameter that cannot be sharded (a scalar; a block-aligned parameter no
dimension splits in whole blocks) lives in a replicated group whatever the
strategy: DDP-style, its gradients all-reduced.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from flatfsdp.engine.layout import ParamLayout
from flatfsdp.engine.strategy import ShardingStrategy


@dataclass(frozen=True)
class GroupPlacement:
    mesh: DeviceMesh
    sharded: bool
    """Main weights, optimizer state and reduced gradients are chunked over the
    mesh (``Shard``); False: every rank holds them whole (``Replicate``)."""
    keep_model_weights: bool
    """The full (unsharded) model weights stay allocated between uses; False:
    gathered before each use and released after (ZeRO-3)."""
    keep_grad_buffer: bool
    """The unsharded gradient accumulation buffer stays allocated between steps;
    False: allocated from a unit's backward to its reduction (ZeRO-2/3)."""

    @classmethod
    def resolve(cls, strategy: ShardingStrategy, mesh: DeviceMesh, *, replicate: bool = False) -> "GroupPlacement":
        if replicate or strategy == ShardingStrategy.NO_SHARD:
            return cls(mesh, sharded=False, keep_model_weights=True, keep_grad_buffer=True)
        return cls(mesh, sharded=True,
                   keep_model_weights=strategy < ShardingStrategy.OPTIM_GRADS_PARAMS,
                   keep_grad_buffer=strategy < ShardingStrategy.OPTIM_GRADS)

    @property
    def world(self) -> int:
        """Ranks a parameter is chunked over (1 when replicated)."""
        return self.mesh.size() if self.sharded else 1

    def dtensor_placements(self, param: ParamLayout) -> tuple[Placement, ...]:
        """The DTensor placement of a parameter's (and its gradient's and optimizer
        state's) local chunk."""
        if param.shard_dim is None:
            return (Replicate(),)
        return (Shard(param.shard_dim),)
