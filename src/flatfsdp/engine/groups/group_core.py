"""The face every param group shows the runtime, and the part of it both kinds share.

Two kinds of group exist: ``param_group.ParamGroup`` (flat buffers the
parameters view) and ``subclass_group.SubclassGroup`` (tensor subclasses that
gather themselves). The runtime, the optimizer binding, state dicts and the
checks after sharding see either through ``ParamGroupFace``; what both do
the same way -- which chunk this rank holds, whether it trains, the DTensor
each parameter is placed as, the stamp that says when the weights changed,
the optimizers bound to it, following a parameter (un)frozen after
sharding, handing the gradient path's calls on -- lives once, in ``GroupCore``.

Outside this package a group is read only through that face: its tensors as
one record (``tensors()``, groups/group_tensors.py), a parameter's part of
them, its memory account and its gradient path's few calls -- never its
buffers or gradients objects.
"""

from __future__ import annotations

import weakref
from typing import Callable, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from flatfsdp.engine.comm.coalesce import GatherRequest, ReduceRequest
from flatfsdp.engine.comm.user_comms import UserAllGather, UserReduceScatter
from flatfsdp.engine.groups.group_tensors import GroupTensors
from flatfsdp.engine.groups.slots import ParamSlot, contiguous_strides
from flatfsdp.engine.layout.arithmetic import GroupLayout
from flatfsdp.engine.layout.main_home import MainHome
from flatfsdp.engine.layout.placement import GroupPlacement


class GroupMemory(Protocol):
    """A group's memory account (groups/buffers.py, subclass_buffers.py)."""

    @property
    def gathered_bytes(self) -> int: ...
    def persistent_bytes(self) -> int: ...
    def persistent_bytes_by_role(self) -> dict[str, int]: ...
    def allocated_bytes(self) -> int: ...
    def flat_buffers(self) -> list[torch.Tensor]: ...
    def held_tensors(self) -> list[torch.Tensor]: ...


@runtime_checkable
class ParamGroupFace(Protocol):
    """A param group as the runtime and the front doors use it."""

    slots: list[ParamSlot]
    params: list[nn.Parameter]
    """What the module computes with."""
    sharded_params: list[nn.Parameter]
    """What the optimizer steps: DTensors placed as FSDP2 places them."""
    placement: GroupPlacement
    layout: GroupLayout
    index: int
    """Which chunk this rank holds (0 when replicated)."""
    trainable: bool
    compute_device: torch.device
    compute_dtype: torch.dtype
    main_dtype: torch.dtype
    home: MainHome
    """Where the main weights and grads live (layout/main_home.py)."""
    bound_optimizers: weakref.WeakSet

    # ---- its tensors ----
    def tensors(self) -> GroupTensors: ...
    def main_chunk(self, index: int) -> torch.Tensor: ...
    def own_chunk_of(self, full: torch.Tensor, index: int) -> torch.Tensor: ...
    def main_view(self, flat: torch.Tensor, index: int) -> torch.Tensor: ...
    def main_grads(self) -> torch.Tensor | None: ...
    def main_grads_held(self) -> bool: ...
    def memory(self) -> GroupMemory: ...
    def broadcast_from_first_replica(self) -> None: ...

    # ---- its gradients ----
    def accumulate_grads(self, include_unused: bool = False) -> bool: ...
    def reduction_request(self, average: bool, divide_factor: float | None = None,
                          hook: Callable | None = None, **flags: bool) -> ReduceRequest | None: ...
    def complete_reduction(self) -> None: ...
    def discard_grads(self, keep_grads: bool = False) -> None: ...
    def scale_grads(self, factor: float) -> None: ...
    def release_consumed_grads(self) -> None: ...
    @property
    def reduction_in_flight(self) -> bool: ...
    @property
    def grads_delivered(self) -> int: ...

    # ---- its weights ----
    @property
    def is_unsharded(self) -> bool: ...
    def gather_request(self) -> GatherRequest | None: ...
    def reshard(self, free_storage: bool = True, keep_codes: bool = False) -> None: ...
    def use_unsharded_params(self) -> None: ...
    def use_sharded_params(self) -> None: ...
    def grad_leaves(self) -> list[nn.Parameter]: ...
    def install_faces(self) -> None: ...
    def note_weights_written(self) -> None: ...
    def refresh_early(self) -> None: ...
    def stamp(self) -> tuple: ...
    def refresh_views(self) -> None: ...
    def adopt_sharded_param(self, index: int, param: nn.Parameter) -> None: ...
    def originals(self) -> list[nn.Parameter]: ...
    def use_custom_all_gather(self, comm) -> None: ...
    def use_custom_reduce_scatter(self, comm) -> None: ...


class GroupCore:
    """State and behaviour both kinds of group share (see the module docstring)."""

    def __init__(self, slots: list[ParamSlot], placement: GroupPlacement, device: torch.device):
        self.placement = placement
        self.index = placement.mesh.get_group().rank() if placement.sharded else 0
        """Which chunk this rank holds (0 when replicated)."""
        original = slots[0].param.dtype
        self.trainable = slots[0].param.requires_grad and original.is_floating_point
        self.compute_device = device
        self.bound_optimizers: weakref.WeakSet = weakref.WeakSet()
        """Optimizers bound by fully_shard_optimizer that step these parameters."""
        self._written = 0
        self._synced: tuple | None = None
        self._unsharded = False

    # ---- the DTensor each parameter is ------------------------------------------------------

    def dtensor_spec(self, index: int) -> tuple:
        """(mesh, placements, ``dtensor_over`` keywords) of parameter ``index``'s sharded DTensor."""
        p, slot = self.layout.params[index], self.slots[index]
        shape = slot.tp.shape if slot.tp is not None else torch.Size(p.shape)
        return (self.placement.dtensor_mesh(slot.fqn), self.placement.dtensor_placements(p, slot.tp),
                dict(shape=torch.Size(shape), stride=contiguous_strides(tuple(shape))))

    # ---- when the weights changed ---------------------------------------------------------

    @property
    def is_unsharded(self) -> bool:
        return self._unsharded

    def note_weights_written(self) -> None:
        """The main weights were written where the engine cannot see it (a bound
        optimizer's step, a load): re-cast and re-gather before next use."""
        self._written += 1

    def stamp(self) -> tuple:
        """Changes whenever the main weights may have changed: a bound optimizer
        step or a load (``_written``); an in-place write the group can see
        (``_storage_version``); an in-place op on a DTensor parameter (their
        version counters -- foreach kernels skip these, which is why bound
        optimizers count their steps); and, for parameters no bound optimizer
        steps, every gradient delivered (an optimizer may have stepped)."""
        delivered = 0 if len(self.bound_optimizers) else self.gradients.delivered
        return (self._written, self._storage_version(), sum(p._version for p in self.sharded_params), delivered)

    def _storage_version(self) -> int:
        """The version of the storage the main weights live in, where it is one tensor."""
        return 0

    def in_sync(self) -> bool:
        """The gathered (kept) weights still match the main weights."""
        return self._synced is not None and self._synced == self.stamp()

    def mark_synced(self) -> None:
        self._synced = self.stamp()

    # ---- the module's parameters ----------------------------------------------------------

    def follow_requires_grad(self, slot: ParamSlot, param: nn.Parameter, sharded: nn.Parameter) -> None:
        """The user (un)froze the sharded parameter after sharding: the
        parameter the module computes with follows, so autograd makes (or
        skips) its gradient. A group frozen when sharded has no gradient
        buffers, so unfreezing it is refused rather than silently not trained."""
        if sharded.requires_grad and not self.trainable:
            raise ValueError(f"parameter '{slot.fqn}' was frozen (requires_grad=False) when it was sharded and has "
                             "been unfrozen since: set requires_grad before fully_shard, so that gradient "
                             "buffers exist for it")
        param.requires_grad_(sharded.requires_grad)

    def install(self, params: list[nn.Parameter]) -> None:
        """Register ``params`` at every place their slots say, following requires_grad."""
        for slot, param, sharded in zip(self.slots, params, self.sharded_params):
            if param is not sharded and param.requires_grad != sharded.requires_grad:
                self.follow_requires_grad(slot, param, sharded)
            for module, attr in slot.locations:
                module._parameters[attr] = param

    def grad_leaves(self) -> list[nn.Parameter]:
        """Every tensor autograd may leave a gradient of this group on (the
        computed-with parameters; ParamGroup adds a looked-up table's faces)."""
        return self.params

    def install_faces(self) -> None:
        """Only a row-lookup table has faces (ParamGroup.install_faces)."""

    def use_sharded_params(self) -> None:
        for slot, sharded in zip(self.slots, self.sharded_params):
            for module, attr in slot.locations:
                module._parameters[attr] = sharded

    # ---- its tensors, through its buffers ----------------------------------------------------

    def main_chunk(self, index: int) -> torch.Tensor:
        """This rank's chunk of parameter ``index`` in the main weights (the sharded DTensor's local tensor)."""
        return self.buffers.main_chunk(index)

    def own_chunk_of(self, full: torch.Tensor, index: int) -> torch.Tensor:
        """This rank's part (chunk; HFSDP: piece) of a full-size value of parameter ``index``."""
        return self.buffers.own_chunk_of(full, index)

    def main_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s part of a main-weights-shaped flat tensor (e.g. the main grads)."""
        return self.buffers.main_view(flat, index)

    def main_grads(self) -> torch.Tensor | None:
        """The flat main grads (None: a frozen group)."""
        return self.buffers.main_grad

    def main_grads_held(self) -> bool:
        """Whether the main grads hold values now (not frozen, not released between steps)."""
        b = self.buffers
        return b.main_grad is not None and (b.main_grad_buffer is None or b.main_grad_buffer.is_allocated)

    def memory(self) -> GroupMemory:
        return self.buffers

    def broadcast_from_first_replica(self) -> None:
        """Every replica takes the first one's main weights: the whole group
        across the shard group where it is replicated there, and across the
        outer dimension as the replica plan says (HSDP); chunks and pieces
        have no replica to agree with."""
        b = self.buffers
        tensors = b.main_tensors()
        with torch.no_grad():
            if not self.placement.sharded and b.pg.size() > 1:
                for t in tensors:
                    b.in_place_collective(t, lambda s: dist.broadcast(s, group=b.pg, group_src=0))
            b.replicas.broadcast_main(tensors, b.home, b.compute_device)

    # ---- its gradient path (groups/gradients.py) ---------------------------------------------

    def accumulate_grads(self, include_unused: bool = False) -> bool:
        return self.gradients.accumulate(include_unused)

    def reduction_request(self, average: bool, divide_factor: float | None = None, hook=None,
                          **flags: bool) -> ReduceRequest | None:
        return self.gradients.reduction_request(average, divide_factor, hook, **flags)

    def complete_reduction(self) -> None:
        self.gradients.complete()

    def discard_grads(self, keep_grads: bool = False) -> None:
        self.gradients.discard(keep_grads)

    def scale_grads(self, factor: float) -> None:
        self.gradients.scale(factor)

    def release_consumed_grads(self) -> None:
        self.gradients.release_consumed()

    @property
    def reduction_in_flight(self) -> bool:
        return self.gradients.in_flight

    @property
    def grads_delivered(self) -> int:
        return self.gradients.delivered

    # ---- a user's FSDP2 collectives (comm/user_comms.py) -----------------------------------

    def use_custom_all_gather(self, comm) -> None:
        """Gather with a user's FSDP2 ``AllGather``: it wraps this group's gather codec."""
        inner = self.buffers.gather_codec
        if inner is not None:
            base = inner.inner if isinstance(inner, UserAllGather) else inner
            self.buffers.gather_codec = UserAllGather(base, comm)

    def use_custom_reduce_scatter(self, comm) -> None:
        """Reduce-scatter with a user's FSDP2 ``ReduceScatter`` (replicated groups all-reduce: unchanged)."""
        if self.placement.sharded and self.trainable:
            self.buffers.reduce_codec = UserReduceScatter(comm, self.buffers.wire.transport)
