"""One unit's parameters whose class gathers itself (FSDP2's all-gather
extension: torchao's float8 weights, NF4 base weights), sharing
requires_grad and placement. The same face to the runtime as ``ParamGroup``
(unshard, reshard, gradients), different insides:

* the optimizer steps a DTensor whose local tensor is this rank's chunk *as
  an instance of the subclass*, made the way FSDP2 makes it (the subclass's
  own ``split`` / ``new_zeros`` / ``copy_``), so its optimizer state, its
  checkpoints and torchao's helpers (``precompute_float8_dynamic_scale_for_fsdp``)
  see what they see under FSDP2;
* gathering runs the subclass's pre-all-gather on that local tensor, moves
  the inputs as bytes (subclass_gather) and rebuilds the computed-with
  parameter with its post-all-gather;
* gradients are plain tensors and take the flat path (subclass_buffers).

Sharded only on dim 0, in equal chunks (what the protocol's implementations
assume); anything else is refused at ``fully_shard`` (see subclass_params).
Replicated groups (NO_SHARD) gather nothing: the module computes with the
parameter itself, whose storage the optimizer's DTensor shares.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from flatfsdp.engine.comm.coalesce import GatherRequest
from flatfsdp.engine.groups.gradients import GroupGradients
from flatfsdp.engine.groups.group_core import GroupCore
from flatfsdp.engine.groups.group_tensors import GroupTensors, plain_values
from flatfsdp.engine.groups.slots import ParamSlot
from flatfsdp.engine.groups.subclass_buffers import SubclassBuffers
from flatfsdp.engine.groups.subclass_gather import SubclassGatherPlan
from flatfsdp.engine.groups.wire_choice import WireChoice
from flatfsdp.engine.layout import views
from flatfsdp.engine.layout.arithmetic import build_group_layout
from flatfsdp.engine.layout.local_dtensor import dtensor_over
from flatfsdp.engine.layout.main_home import DEVICE
from flatfsdp.engine.layout.placement import GroupPlacement
from flatfsdp.engine.layout.precision import MixedPrecisionPolicy
from flatfsdp.engine.layout.switches import Transport


class SubclassGroup(GroupCore):
    def __init__(self, slots: list[ParamSlot], *, placement: GroupPlacement, policy: MixedPrecisionPolicy,
                 device: torch.device, transport: Transport):
        super().__init__(slots, placement, device)
        original = slots[0].param.dtype
        self.home = DEVICE
        # The main weights are the subclass's own: gradients match their dtype.
        self.main_dtype = original
        self.reduce_dtype = policy.reduction_dtype(original)
        self.compute_dtype = param_dtype = policy.compute_dtype(original)
        world = placement.world
        self.layout = build_group_layout([s.local_shape for s in slots], world, [s.shard_dim for s in slots])
        locals_ = [self._local_chunk(s.param.detach(), world) for s in slots]
        plan = None
        if placement.sharded:
            plan = SubclassGatherPlan(
                mesh=placement.mesh, world=world, shapes=[s.param.shape for s in slots],
                modules=[s.locations[0][0] for s in slots], mp_policy=_fsdp2_policy(policy),
                param_dtypes=[param_dtype] * len(slots), requires_grad=[s.param.requires_grad for s in slots],
                device=device, transport=transport, locals_=self.sharded_locals)
            # The full-size originals are dropped (an optimizer built on them
            # still finds them, see ``originals``); a meta stand-in records each
            # one's shape and flags.
            self._originals = [weakref.ref(s.param) for s in slots]
            slots = [_with_stand_in(s) for s in slots]
        self.plan = plan
        self.slots = slots
        self.params: list[nn.Parameter] = [s.param for s in slots]
        """What the module computes with: the rebuilt parameter once gathered
        (a replicated group: the original parameter itself)."""
        self.sharded_params: list[nn.Parameter] = []
        grad_dtensors = []
        # Their gradients reduce in reduce_dtype, never as codes.
        wire = WireChoice(transport)
        self.buffers = SubclassBuffers(self.layout, placement, index=self.index, device=device,
                                       main_dtype=self.main_dtype, reduce_dtype=self.reduce_dtype,
                                       trainable=self.trainable, locals_=self.sharded_locals, plan=plan, wire=wire)
        for index, local in enumerate(locals_):
            mesh, placements, spec = self.dtensor_spec(index)
            with torch.no_grad():
                sharded = dtensor_over(local, mesh, placements, **spec)
            self.sharded_params.append(nn.Parameter(sharded, requires_grad=slots[index].param.requires_grad))
            if self.trainable:
                grad = self.buffers.main_view(self.buffers.main_grad, index)
                grad_dtensors.append(dtensor_over(grad, mesh, placements, **spec))
        self.gradients = GroupGradients(self.buffers, self.slots, self.params, self.sharded_params, grad_dtensors,
                                        self.bound_optimizers)
        self._swapped_in = False

    def _local_chunk(self, full: torch.Tensor, world: int) -> torch.Tensor:
        """This rank's rows as the subclass builds them (FSDP2's sequence:
        chunk, a zeroed tensor of the chunk's shape, copy)."""
        if not self.placement.sharded:
            return full
        chunk = torch.chunk(full, world, dim=0)[self.index]
        with torch.no_grad():
            local = full.new_zeros(chunk.shape)
            local.copy_(chunk)
        return local

    def originals(self) -> list[nn.Parameter]:
        """The parameters as the user built them, where still alive (an
        optimizer built before sharding holds them), else their stand-ins."""
        if self.plan is None:
            return [s.param for s in self.slots]
        alive = [ref() for ref in self._originals]
        return [s.param if original is None else original for original, s in zip(alive, self.slots)]

    def tensors(self) -> GroupTensors:
        """The record of groups/group_tensors.py: the main grads are the
        engine's own; the weights, held as subclass instances, are flat copies
        of their plain values (the same copy stands for the model weights:
        the subclass rebuilds what the module computes with at each gather)."""
        b, place = self.buffers, self.placement
        with torch.no_grad():
            values = [plain_values(local.detach()) for local in self.sharded_locals()]
            flat = torch.zeros(self.layout.shard_numel, dtype=values[0].dtype, device=values[0].device)
            for p, value in zip(self.layout.params, values):
                views.local_chunk(flat, p, self.index).copy_(value)
        model = flat if flat.dtype == self.compute_dtype else flat.to(self.compute_dtype)
        return GroupTensors(
            model_weights=model, model_weights_sharded=place.sharded, main_weights=flat,
            main_in_model_weights=False, main_grads=b.main_grad, sharded=place.sharded, process_group=b.pg,
            rank_index=self.index, world=place.world, compute_dtype=self.compute_dtype, main_dtype=flat.dtype,
            engine_storage=False, layout=self.layout, main_view=b.main_view)

    def sharded_locals(self) -> list[torch.Tensor]:
        """Each sharded parameter's local tensor, read afresh: the object may
        be replaced (a load, ``adopt_sharded_param``) or given attributes
        (torchao's precomputed float8 scale) between gathers."""
        return [p._local_tensor for p in self.sharded_params]

    def refresh_views(self) -> None:
        """Nothing views a flat buffer here; kept for the group interface."""

    def adopt_sharded_param(self, index: int, param: nn.Parameter) -> None:
        """The DTensor ``param`` (placed as ours, its values already copied into
        our local tensor) becomes sharded parameter ``index``: its contents are
        swapped for ours, the object (which an optimizer may hold) is kept."""
        ours = self.sharded_params[index]
        param.grad = None
        torch.utils.swap_tensors(param, nn.Parameter(ours.detach(), requires_grad=param.requires_grad))
        self.sharded_params[index] = param

    # ---- weights ------------------------------------------------------------------------

    def gather_request(self) -> GatherRequest | None:
        """Run the pre-all-gathers and say what to gather (None: nothing to
        communicate -- already gathered, replicated, or the kept copy is current)."""
        if self._unsharded:
            return None
        self._unsharded = True
        if self.plan is None:
            return None
        if self.placement.keep_model_weights and self.in_sync():
            return None
        codec = self.buffers.gather_codec
        codec.refresh()  # the pre-all-gathers: before every gather
        return GatherRequest(codec, self.buffers.pg, then=[self._gathered])

    def refresh_early(self) -> None:
        """Nothing to start ahead: the subclass's pre-all-gather runs at the gather."""

    def _gathered(self) -> None:
        self.mark_synced()
        for index, param in enumerate(self.plan.unsharded):
            self.params[index] = param
        if self._swapped_in:
            self.install(self.params)

    def reshard(self, free_storage: bool = True, keep_codes: bool = False) -> None:
        """``free_storage=False``: FSDP2's ``set_keep_unsharded_storage``.
        ``keep_codes`` is for low-bit groups; subclass parameters gather their
        own bytes each time (their class decides what travels)."""
        self._unsharded = False
        if free_storage and self.plan is not None and not self.placement.keep_model_weights:
            self.plan.free()

    def use_unsharded_params(self) -> None:
        """The rebuilt parameters go in once the first gather has made them
        (``_gathered``); after that they are the same objects every time."""
        self._swapped_in = True
        if self.plan is None or all(p is not None for p in self.plan.unsharded):
            self.install(self.params)

    def use_sharded_params(self) -> None:
        self._swapped_in = False
        super().use_sharded_params()


def _with_stand_in(slot: ParamSlot) -> ParamSlot:
    stand_in = nn.Parameter(torch.empty(slot.param.shape, dtype=slot.param.dtype, device="meta"),
                            requires_grad=slot.param.requires_grad)
    return ParamSlot(slot.fqn, stand_in, slot.locations, slot.keys, slot.shard_dim, slot.tp)


def _fsdp2_policy(policy: MixedPrecisionPolicy):
    """FSDP2's policy object, for pre-all-gathers that take one (they read ``param_dtype``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2Policy
    return FSDP2Policy(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype)
