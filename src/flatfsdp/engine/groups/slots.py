"""What a unit knows about each of its parameters before they are grouped:
every place the parameter is registered, the dimension chunked across ranks,
and, for a tensor-parallel DTensor, what its local tensor stands for."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flatfsdp.engine.layout.placement import TensorParallelSpec


@dataclass(frozen=True)
class ParamSlot:
    """One parameter of a unit: every (module, attribute) that registers it."""

    fqn: str
    param: nn.Parameter
    locations: tuple[tuple[nn.Module, str], ...]
    keys: tuple[tuple[int, str], ...] = ()
    """The state-dict key of every location: (which of the unit's modules it
    is under, the key relative to that module)."""
    shard_dim: int | None = 0
    """The dimension chunked across ranks (None: replicated)."""
    tp: TensorParallelSpec | None = None
    """Set when the parameter arrived as a DTensor: its local tensor is what is sharded here."""

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape flatfsdp shards: the parameter's, or its local tensor's."""
        return tuple(self.param.to_local().shape if self.tp is not None else self.param.shape)

    def with_dim(self, dim: int | None) -> "ParamSlot":
        return ParamSlot(self.fqn, self.param, self.locations, self.keys, dim, self.tp)


def local_value(param: torch.Tensor) -> torch.Tensor:
    """The values this rank shards: a DTensor's local tensor, or the tensor itself."""
    return (param.to_local() if isinstance(param, DTensor) else param).detach()


def local_grad(grad: torch.Tensor, tp: TensorParallelSpec | None) -> torch.Tensor:
    """A tensor-parallel parameter's gradient as its local tensor, placed as
    the parameter is (a partial sum is reduced over the tensor-parallel mesh first)."""
    if not isinstance(grad, DTensor):
        return grad
    if tp is None:
        return grad.to_local()
    # On FSDP2's SPMD mesh the data-parallel dimensions are left as they are
    # (a partial sum there is this rank's contribution): the reduction sums them.
    wanted = tuple(grad.placements[i] if i in tp.data_parallel_dims else p for i, p in enumerate(tp.placements))
    if tuple(grad.placements) != wanted:
        grad = grad.redistribute(tp.mesh, wanted)
    return grad.to_local()


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))
