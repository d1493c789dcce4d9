"""The face every param group shows the runtime, and the part of it both kinds share.

Two kinds of group exist: ``param_group.ParamGroup`` (flat buffers the
parameters view) and ``subclass_group.SubclassGroup`` (tensor subclasses that
gather themselves). The runtime, the optimizer binding, state dicts and the
checks after sharding see either through ``ParamGroupFace``; what both do
the same way -- which chunk this rank holds, whether it trains, the DTensor
each parameter is placed as, the stamp that says when the weights changed,
the optimizers bound to it, following a parameter (un)frozen after
sharding -- lives once, in ``GroupCore``.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch
from torch import nn

from flatfsdp.engine.comm.coalesce import GatherRequest
from flatfsdp.engine.comm.user_comms import UserAllGather, UserReduceScatter
from flatfsdp.engine.groups.slots import ParamSlot, contiguous_strides
from flatfsdp.engine.layout.placement import GroupPlacement


class ParamGroupFace(Protocol):
    """A param group as the runtime uses it."""

    slots: list[ParamSlot]
    params: list[nn.Parameter]
    """What the module computes with."""
    sharded_params: list[nn.Parameter]
    """What the optimizer steps: DTensors placed as FSDP2 places them."""
    placement: GroupPlacement
    trainable: bool
    compute_device: torch.device
    bound_optimizers: weakref.WeakSet
    buffers: object
    gradients: object

    @property
    def is_unsharded(self) -> bool: ...
    def gather_request(self) -> GatherRequest | None: ...
    def reshard(self, free_storage: bool = True, keep_codes: bool = False) -> None: ...
    def use_unsharded_params(self) -> None: ...
    def use_sharded_params(self) -> None: ...
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
        """(mesh, placements, from_local keywords) of parameter ``index``'s sharded DTensor."""
        p, slot = self.layout.params[index], self.slots[index]
        shape = slot.tp.shape if slot.tp is not None else torch.Size(p.shape)
        return (self.placement.dtensor_mesh(slot.fqn), self.placement.dtensor_placements(p, slot.tp),
                dict(shape=torch.Size(shape), stride=contiguous_strides(tuple(shape)), run_check=False))

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

    def use_sharded_params(self) -> None:
        for slot, sharded in zip(self.slots, self.sharded_params):
            for module, attr in slot.locations:
                module._parameters[attr] = sharded

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
