"""One unit's parameters that share (dtype, requires_grad, placement): the
parameters the module computes with and the DTensors the optimizer steps,
both views of the group's flat buffers (buffers.py), and keeping the gathered
weights current -- unshard, reshard. The gradient path is gradients.py.

The optimizer sees each parameter as a DTensor whose local tensor is its
chunk of the main weights, placed ``Shard(dim)`` (torch.chunk's rule) or
``Replicate()``; its ``.grad`` views the main grads the same way. The module
computes with views of the unsharded buffer.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flatfsdp.engine.comm.coalesce import GatherRequest
from flatfsdp.engine.groups.buffers import GroupBuffers
from flatfsdp.engine.groups.gradients import GroupGradients
from flatfsdp.engine.groups.slots import ParamSlot, contiguous_strides, local_value
from flatfsdp.engine.layout import views
from flatfsdp.engine.layout.arithmetic import build_group_layout
from flatfsdp.engine.layout.offload import HostOffload
from flatfsdp.engine.layout.placement import GroupPlacement
from flatfsdp.engine.layout.precision import MixedPrecisionPolicy

DIRECT_MIN_BYTES = 256 << 10
"""Chunk slots this large are received straight into place; smaller ones travel
together and are copied out (a message costs ~0.1 ms on gloo here, copying
256 KiB about as much)."""


class ParamGroup:
    def __init__(self, slots: list[ParamSlot], *, placement: GroupPlacement, policy: MixedPrecisionPolicy,
                 device: torch.device, fill: bool = True, offload: HostOffload | None = None):
        """``fill=False``: the caller writes the main weights' chunks itself
        (the parameters' values are not read). ``offload``: the main weights
        and grads live in host memory (see layout/offload.py)."""
        self.slots = slots
        self.params = [s.param for s in slots]
        """What the module computes with: the original parameters (their data
        made views of the unsharded buffer), or for tensor-parallel ones a
        DTensor of that view (built in _make_views)."""
        self.placement = placement
        self.index = placement.mesh.get_group().rank() if placement.sharded else 0
        """Which chunk this rank holds (0 when replicated)."""
        original = self.params[0].dtype
        self.trainable = self.params[0].requires_grad and original.is_floating_point
        self.offload = offload
        self.compute_device = device
        self.compute_dtype = policy.compute_dtype(original)
        # Frozen parameters keep their own dtype: nothing steps them, and their
        # DTensors (and checkpoints) must hold the values they were given.
        self.main_dtype = policy.main_dtype(original) if self.trainable else original
        self.reduce_dtype = policy.reduction_dtype(original)
        itemsize = torch.empty((), dtype=self.compute_dtype).element_size()
        self.layout = build_group_layout([s.local_shape for s in slots], placement.world,
                                         [s.shard_dim for s in slots], direct_min_numel=DIRECT_MIN_BYTES // itemsize)
        lowbit = policy.gather_format if self.compute_dtype.is_floating_point else None
        if lowbit is not None and offload is not None:
            raise NotImplementedError(f"param_gather_dtype={lowbit.kind!r} with CPU offload (parameter "
                                      f"'{slots[0].fqn}'): low-bit gathers read the main weights on the device")
        self.buffers = GroupBuffers(self.layout, placement, index=self.index, device=device,
                                    compute_dtype=self.compute_dtype, main_dtype=self.main_dtype,
                                    reduce_dtype=self.reduce_dtype, trainable=self.trainable, offload=offload,
                                    lowbit=lowbit, grad_lowbit=policy.reduce_format if self.trainable else None)
        self.bound_optimizers: weakref.WeakSet = weakref.WeakSet()
        """Optimizers bound by fully_shard_optimizer that step these parameters."""
        self._written = 0
        self._synced: tuple | None = None
        self._unsharded = False
        if fill:
            self._fill_from_params()
        self.gradients = self._make_views()

    # ---- construction -------------------------------------------------------------------

    def _fill_from_params(self) -> None:
        """Main weights straight from the original values (fp32 main weights keep
        full precision even when compute is bf16); kept model weights too."""
        b = self.buffers
        values = [local_value(p) for p in self.params]
        with torch.no_grad():
            if self.placement.keep_model_weights:
                for p, value in zip(self.layout.params, values):
                    views.unsharded_param(b.unsharded.data, p).copy_(value)
            if not b.main_in_unsharded:
                for index, value in enumerate(values):
                    b.main_chunk(index).copy_(b.own_chunk_of(value, index))
            # Replicas must agree: the first replica's values win.
            if not self.placement.sharded and b.pg.size() > 1:
                b.in_place_collective(b.main, lambda t: torch.distributed.broadcast(t, group=b.pg, group_src=0))
            if b.outer_pg is not None and b.outer_shard is None:
                b.in_place_collective(b.main, lambda t: torch.distributed.broadcast(t, group=b.outer_pg,
                                                                                    group_src=0))
        # Model weights are synced from the main weights before first use
        # (ZeRO-1/2 gather them, so every replica agrees).
        self._synced = None

    def _make_views(self) -> GroupGradients:
        """Original parameters become views of the unsharded buffer; the
        optimizer-facing DTensors view the main weights' and grads' chunks."""
        b = self.buffers
        self.sharded_params, grad_dtensors = [], []
        for index in range(len(self.slots)):
            self.params[index] = self._compute_param(index)
            mesh, placements, spec = self._dtensor_spec(index)
            local = DTensor.from_local(b.main_chunk(index), mesh, placements, **spec)
            self.sharded_params.append(nn.Parameter(local, requires_grad=self.trainable))
            if self.trainable:
                grad = b.main_view(b.main_grad, index)
                grad_dtensors.append(DTensor.from_local(grad, mesh, placements, **spec))
        if not self.placement.keep_model_weights:
            b.unsharded.free()
        return GroupGradients(b, self.slots, self.params, self.sharded_params, grad_dtensors, self.bound_optimizers)

    def _compute_param(self, index: int) -> nn.Parameter:
        view = views.unsharded_param(self.buffers.unsharded.data, self.layout.params[index])
        slot = self.slots[index]
        if slot.tp is None:
            param = self.params[index]
            param.data = view
            return param
        tp = slot.tp
        local = DTensor.from_local(view, tp.mesh, tp.placements, shape=tp.shape,
                                   stride=contiguous_strides(tp.shape), run_check=False)
        return nn.Parameter(local, requires_grad=self.params[index].requires_grad)

    def _dtensor_spec(self, index: int) -> tuple:
        """(mesh, placements, from_local keywords) of parameter ``index``'s sharded DTensor."""
        p, slot = self.layout.params[index], self.slots[index]
        shape = slot.tp.shape if slot.tp is not None else torch.Size(p.shape)
        return (self.placement.dtensor_mesh(slot.fqn), self.placement.dtensor_placements(p, slot.tp),
                dict(shape=torch.Size(shape), stride=contiguous_strides(shape), run_check=False))

    def refresh_views(self) -> None:
        """Make the existing sharded parameter objects view this group's main
        weights again (torch's conversions swap a DTensor parameter's contents
        for the converted copy; swap ours back in, keeping the objects)."""
        for index, sharded in enumerate(self.sharded_params):
            self.adopt_sharded_param(index, sharded)

    def adopt_sharded_param(self, index: int, param: nn.Parameter) -> None:
        """Make the DTensor parameter object ``param`` sharded parameter
        ``index``, viewing the main weights (its contents are swapped, the
        object is kept): ours again after a conversion, or one the user put in
        its place (the object they, and an optimizer built on it, hold is the
        one trained)."""
        mesh, placements, spec = self._dtensor_spec(index)
        local = DTensor.from_local(self.buffers.main_chunk(index), mesh, placements, **spec)
        param.grad = None
        torch.utils.swap_tensors(param, nn.Parameter(local, requires_grad=param.requires_grad))
        self.sharded_params[index] = param

    def originals(self) -> list[nn.Parameter]:
        """The parameters as the user built them (their data now views the buffers)."""
        return [s.param for s in self.slots]

    # ---- weights ------------------------------------------------------------------------

    @property
    def is_unsharded(self) -> bool:
        return self._unsharded

    def note_weights_written(self) -> None:
        """The main weights were written where the engine cannot see it (a bound
        optimizer's step, a load): re-cast and re-gather before next use."""
        self._written += 1

    def _stamp(self) -> tuple:
        """Changes whenever the main weights may have changed: a bound optimizer
        step or a load (``_written``); a plain in-place write into the main
        buffer (its version counter); an in-place op on a DTensor parameter
        (their version counters -- foreach kernels skip these, which is why
        bound optimizers count their steps); and, for parameters no bound
        optimizer steps, every gradient delivered (an optimizer may have stepped)."""
        delivered = 0 if len(self.bound_optimizers) else self.gradients.delivered
        return self._written, self.buffers.main._version, sum(p._version for p in self.sharded_params), delivered

    def _in_sync(self) -> bool:
        return self._synced is not None and self._synced == self._stamp()

    def _mark_synced(self) -> None:
        self._synced = self._stamp()

    def gather_request(self) -> GatherRequest | None:
        """Mark the group gathered and say what to all-gather for it (None:
        nothing to communicate -- already gathered, or the kept copy is current)."""
        if self._unsharded:
            return None
        self._unsharded = True
        b = self.buffers
        if not self.placement.keep_model_weights:
            if b.lowbit is not None:
                if not self._in_sync():
                    self._encode()  # once per optimizer step, however many gathers
                    self._mark_synced()
            elif b.model_local is not b.main and not self._in_sync():
                with torch.no_grad():
                    if b.outer_shard is not None:
                        b.outer_shard.all_gather(b.main, b.model_local)  # once per optimizer step
                    else:
                        b.model_local.copy_(b.main, non_blocking=self.offload is not None)
                self._mark_synced()
            b.unsharded.alloc()
            kept = b.lowbit is not None and b.gather_plan.kept is not None
            return GatherRequest(b.gather_plan, b.pg, local=kept)
        if self._in_sync():
            return None
        if b.lowbit is not None:
            self._encode()
            return GatherRequest(b.gather_plan, b.pg, then=[self._mark_synced])
        self._cast_main_into_model_weights()
        if not self.placement.sharded:
            self._mark_synced()
            return None
        return GatherRequest(b.gather_plan, b.pg, then=[self._mark_synced])

    def _encode(self) -> None:
        """This rank's low-bit row from the main weights (HFSDP: from every
        replica's piece, gathered across the outer dimension as codes)."""
        b = self.buffers
        with torch.no_grad():
            if b.outer_shard is not None:
                b.outer_shard.all_gather_lowbit(b.main, b.gather_plan)
            else:
                b.gather_plan.encode(b.main_chunk)

    def _cast_main_into_model_weights(self) -> None:
        """Kept model weights with a separate main copy: this rank's chunks, cast."""
        b = self.buffers
        if b.main_in_unsharded:
            return
        with torch.no_grad():
            if not self.placement.sharded:
                b.unsharded.data.copy_(b.main)
                return
            torch._foreach_copy_([views.unsharded_chunk(b.unsharded.data, p, self.index)
                                  for p in self.layout.params],
                                 [b.main_chunk(i) for i in range(len(self.params))])

    def reshard(self, free_storage: bool = True, keep_codes: bool = False) -> None:
        """Release the gathered weights (ZeRO-3 only; the others keep them).
        ``free_storage=False`` keeps their storage allocated (FSDP2's
        ``set_keep_unsharded_storage``): the next gather lands at the same address.
        ``keep_codes``: a training forward ends and its backward will gather
        again; low-bit codes stay held for it (Note [kept codes])."""
        self._unsharded = False
        if self.buffers.lowbit is not None and not keep_codes:
            self.buffers.gather_plan.kept = None
        if free_storage and not self.placement.keep_model_weights:
            self.buffers.unsharded.free()

    def use_unsharded_params(self) -> None:
        for slot, param, sharded in zip(self.slots, self.params, self.sharded_params):
            if param.requires_grad != sharded.requires_grad:
                self._follow_requires_grad(slot, param, sharded)
            for module, attr in slot.locations:
                module._parameters[attr] = param

    def _follow_requires_grad(self, slot: ParamSlot, param: nn.Parameter, sharded: nn.Parameter) -> None:
        """The user (un)froze the sharded parameter after sharding: the
        parameter the module computes with follows, so autograd makes (or
        skips) its gradient. A group frozen when sharded has no gradient
        buffers, so unfreezing it is refused rather than silently not trained."""
        if sharded.requires_grad and not self.trainable:
            raise ValueError(f"parameter '{slot.fqn}' was frozen (requires_grad=False) when it was sharded and has "
                             "been unfrozen since: set requires_grad before fully_shard, so that gradient "
                             "buffers exist for it")
        param.requires_grad_(sharded.requires_grad)

    def use_sharded_params(self) -> None:
        for slot, sharded in zip(self.slots, self.sharded_params):
            for module, attr in slot.locations:
                module._parameters[attr] = sharded
