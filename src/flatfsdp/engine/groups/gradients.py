"""A param group's gradient path: autograd's gradients on the unsharded
parameters -> the rank-major accumulation buffer -> a reduction (issued by
the caller, perhaps coalesced) -> this rank's main grads -> the ``.grad``
DTensors the optimizer reads.

Holds only what it needs from its group (the buffers and the parameter
lists, shared and kept current by the group), never the group itself: a
group and its gradients in a reference cycle would keep a replaced group's
buffers alive until Python's cycle collector ran.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flatfsdp.engine.comm.coalesce import ReduceRequest
from flatfsdp.engine.groups.buffers import GradientBuffers
from flatfsdp.engine.groups.slots import ParamSlot, local_grad
from flatfsdp.engine.layout import views
from flatfsdp.engine.layout.buffer import FlatBuffer


class GroupGradients:
    def __init__(self, buffers: GradientBuffers, slots: list[ParamSlot], params: list[nn.Parameter],
                 sharded_params: list[nn.Parameter], grad_dtensors: list[DTensor],
                 bound_optimizers: weakref.WeakSet, faces: list | None = None):
        """``params`` and ``sharded_params`` are the group's own lists (it
        updates them in place); ``grad_dtensors[i]`` views parameter i's part
        of the main grads, placed as its sharded parameter."""
        self.buffers, self.slots, self.params = buffers, slots, params
        self.sharded_params, self.grad_dtensors = sharded_params, grad_dtensors
        self.bound_optimizers = bound_optimizers
        self.faces = faces if faces is not None else []
        """The group's (index, leaf) faces of a row-lookup table (param_group), shared."""
        self.delivered = 0
        """Reductions delivered so far (an unbound optimizer may have stepped after each)."""
        self._accum: FlatBuffer | None = None
        self._inflight: ReduceRequest | None = None
        self._used = [False] * len(params)
        self._destinations: dict[int, list] = {}
        self._zero_plans: dict[int, tuple] = {}

    @property
    def trainable(self) -> bool:
        return self.buffers.main_grad is not None

    # ---- accumulation -------------------------------------------------------------------

    def accumulate(self, include_unused: bool = False) -> bool:
        """Move the gradients autograd left on the unsharded parameters into the
        rank-major accumulation buffer. Returns whether there were any.

        ``include_unused`` (FSDP2's ``set_reduce_scatter_unused_params``): a
        parameter without a gradient on this rank counts as a zero gradient,
        so every parameter of the group gets its reduced ``.grad`` on every
        rank -- needed when ranks use different parameters (routing), where
        otherwise only the ranks that used one would step their chunk of it."""
        if not self.trainable:
            return False
        pairs = [(i, p.grad) for i, p in enumerate(self.params) if p.grad is not None]
        faced = [(i, face.grad) for i, face in self.faces if face.grad is not None]
        if not pairs and not faced and not include_unused:
            return False
        fresh = self._accum is None
        if fresh:
            self.wait()
            self._accum = self._pick_accumulation_buffer()
            self._accum.alloc()
        destinations = self._grad_destinations(self._accum)
        layout = self.buffers.layout
        dst, src = [], []
        for i, grad in pairs:
            dst += destinations[i]
            src += views.grad_sources(local_grad(grad, self.slots[i].tp), layout.params[i])
        written = {i for i, _ in pairs}
        face_copy, face_add = self._face_sources(faced, destinations, fresh, written) if faced else (None, None)
        with torch.no_grad():
            if fresh:
                self._zero_unwritten(self._accum, written)
            if dst:
                (torch._foreach_copy_ if fresh else torch._foreach_add_)(dst, src)
            if face_copy:
                torch._foreach_copy_(*face_copy)
            if face_add:
                torch._foreach_add_(*face_add)
        if self.faces:  # a row-lookup table's codec: what this accumulation holds (comm/lookup_rows.RowsReduce)
            self.buffers.reduce_codec.note_accumulated(lookup=bool(pairs), dense=bool(faced))
        for i, _ in pairs:
            self._used[i] = True
            self.params[i].grad = None
        for i, face in self.faces:
            if face.grad is not None:
                self._used[i] = True
                face.grad = None
        if include_unused:  # a parameter frozen since sharding stays without a gradient (as in FSDP2)
            self._used = [used or p.requires_grad for used, p in zip(self._used, self.params)]
        return True

    def _face_sources(self, faced: list, destinations: list, fresh: bool, written: set[int]) -> tuple:
        """(copies, additions) as foreach argument pairs for the faces'
        gradients: copied into a fresh buffer's slot nothing else wrote (no
        zeroing first; ``written`` gains it), else summed in after the copies."""
        copies, additions = ([], []), ([], [])
        layout = self.buffers.layout
        for i, grad in faced:
            into = copies if fresh and i not in written else additions
            written.add(i)
            into[0].extend(destinations[i])
            into[1].extend(views.grad_sources(local_grad(grad, self.slots[i].tp), layout.params[i]))
        return (copies if copies[0] else None), (additions if additions[0] else None)

    def _grad_destinations(self, buffer: FlatBuffer) -> list:
        key = id(buffer)
        if key not in self._destinations:
            layout = self.buffers.layout
            self._destinations[key] = [views.grad_destinations(buffer.data, layout, p) for p in layout.params]
        return self._destinations[key]

    def _zero_unwritten(self, buffer: FlatBuffer, written: set[int]) -> None:
        """Zero alignment gaps, padding and the slots of parameters that got no gradient."""
        key = id(buffer)
        if key not in self._zero_plans:
            flat, layout = buffer.data, self.buffers.layout
            slots = [views.unsharded_param(flat, p) if p.shard_dim is None
                     else views.wire_slots(views.wire_table(flat, layout), p) for p in layout.params]
            pads = [views.grad_padding(flat, layout, p) for p in layout.params]
            self._zero_plans[key] = (views.gaps(flat, layout, layout.world), slots, pads)
        gaps, slots, pads = self._zero_plans[key]
        zero = list(gaps)
        for i in range(len(self.params)):
            zero += pads[i] if i in written else [slots[i]]
        if zero:
            torch._foreach_zero_(zero)

    def _pick_accumulation_buffer(self) -> FlatBuffer:
        # While the optimizer still holds grads in a buffer that doubles as the
        # accumulation buffer, a new microbatch accumulates aside.
        if self.buffers.grads_aliased and self.has_data():
            return self.buffers.scratch_grad
        return self.buffers.grads

    def has_data(self) -> bool:
        """Whether the optimizer still holds (has not dropped) any delivered grad."""
        return any(sp.grad is not None for sp in self.sharded_params)

    # ---- reduction ----------------------------------------------------------------------

    def reduction_request(self, average: bool, divide_factor: float | None = None, hook=None, *,
                          all_reduce: bool = True, defer_to_step: bool = False,
                          sum_only: bool = False) -> ReduceRequest | None:
        """Hand over the accumulated local gradients for reduction into the main
        grads (summing into what the optimizer has not consumed yet, as autograd
        would). The request is issued by the caller, perhaps coalesced.

        With replicas (HSDP) the reduced chunks are then all-reduced across
        them -- unless ``all_reduce`` is False (FSDP2's
        ``set_requires_all_reduce``), or ``defer_to_step`` and a bound optimizer
        will ask for it before stepping (``complete``): outer traffic once per
        optimizer step, however many microbatches."""
        if self._accum is None:
            return None
        b, replicas = self.buffers, self.buffers.replicas
        accum, has_data = self._accum, self.has_data()
        self._accum = None
        if not has_data:
            replicas.grads_dropped()
        if b.main_grad_buffer is not None:
            b.main_grad_buffer.alloc()  # no-op unless released since the last step
        if divide_factor is not None:
            divisor = float(divide_factor)
        else:
            divisor = float(b.placement.dp.average_over) if average else 1.0
        codec = b.reduce_codec
        if not b.placement.sharded:
            request = ReduceRequest("all_reduce", accum.data, accum.data, b.pg, codec)
        else:
            # Straight into the main grads where nothing is summed into them and
            # nothing follows on another layout or in another memory.
            direct = (not has_data and b.main_grad.dtype == b.reduce_dtype and not replicas.splits_main
                      and b.home.shares_device_memory)
            result = b.main_grad if direct else torch.empty(
                b.layout.shard_numel, dtype=b.reduce_dtype, device=b.compute_device)
            # FSDP2's custom collectives average in the collective (ReduceOp.AVG) where it would.
            average = (not sum_only and replicas.lets_collective_average
                       and codec.averages(divisor, b.pg, b.reduce_dtype))
            request = ReduceRequest("reduce_scatter", accum.data, result, b.pg, codec, average=average)
            if average:
                divisor = 1.0
        outer_now = all_reduce and not (defer_to_step and len(self.bound_optimizers))
        landed = replicas.follow_up(request, outer_now)
        if b.placement.sharded and (accum is b.scratch_grad or not b.placement.keep_grad_buffer):
            request.landed.append(accum.free)  # reduced: the follow-up needs only the (shard-sized) output
        # The callback names the output, not the request: a request holding a
        # closure over itself is a reference cycle, and its output (a fresh
        # shard-sized buffer for HFSDP and bf16 reductions) would then live
        # until Python's cycle collector ran, not until delivered.
        output = request.output
        request.then.append(lambda: self._finish(accum, output, has_data, divisor, outer_now, landed))
        if hook is not None:
            request.then.append(lambda: (hook(b.main_grad), b.sync_optimizer_grad()))
        self._inflight = request
        return request

    def complete(self) -> None:
        """Wait for the reduction in flight and do any reduction across
        replicas still owed: the main grads are then final."""
        self.wait()
        self.buffers.replicas.complete(self)

    def all_reduce_main_grads(self, group) -> None:
        """Sum the main grads across ``group`` (the replicas), in place."""
        b = self.buffers
        b.in_place_collective(b.main_grad, lambda t: b.reduce_codec.all_reduce(t, group).wait())
        b.sync_optimizer_grad()

    def release_consumed(self) -> None:
        """Free the sharded main grads once the optimizer has set every grad to
        None (``zero_grad()``): nothing reads them until the next reduction,
        which re-allocates and overwrites them. Between steps a ZeRO-2/3 rank
        then holds no gradient memory at all, as with autograd's own grads --
        it is the forward's activations that grads would otherwise sit beside."""
        b = self.buffers
        if self._inflight is None and self._accum is None and not self.has_data():
            if b.main_grad_buffer is not None:
                b.main_grad_buffer.free()
            if b.optim_grad is not None:
                b.optim_grad.free()

    def scale(self, factor: float) -> None:
        """Multiply every gradient this group holds -- reduced (main grads) and
        accumulated but not yet reduced -- by ``factor`` (Megatron-FSDP's
        ``scale_gradients``). Reductions in flight land first."""
        if not self.trainable:
            return
        self.complete()
        b = self.buffers
        with torch.no_grad():
            if self._accum is not None:
                self._accum.data.mul_(factor)
            if b.main_grad_buffer is None or b.main_grad_buffer.is_allocated:
                b.main_grad.mul_(factor)
                b.sync_optimizer_grad()

    def discard(self, keep_grads: bool = False) -> None:
        """Forget every gradient of the step so far (Megatron-FSDP's
        ``zero_grad_buffer``): reductions in flight land and are dropped, the
        local accumulation is dropped and the optimizer's ``.grad`` set to
        None, so the next reduction overwrites the main grads (zeroing them
        first would be a memset per step for nothing; ZeRO-2/3 release them
        at the next forward anyway). ``keep_grads``: ``.grad`` stays,
        zeroed, and the next reduction sums into it (``zero_grad(set_to_none=False)``)."""
        if not self.trainable:
            return
        self.complete()
        b = self.buffers
        if self._accum is not None:
            if self._accum is b.scratch_grad or not b.placement.keep_grad_buffer:
                self._accum.free()
            self._accum = None
        self._used = [False] * len(self.params)
        self.buffers.replicas.grads_dropped()
        if not keep_grads:
            for sp in self.sharded_params:
                sp.grad = None
            return
        with torch.no_grad():
            if b.main_grad_buffer is None or b.main_grad_buffer.is_allocated:
                b.main_grad.zero_()
                b.sync_optimizer_grad()

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    def wait(self) -> None:
        if self._inflight is not None:
            self._inflight.wait()

    def _finish(self, accum: FlatBuffer, result: torch.Tensor, has_data: bool, divisor: float,
                outer_now: bool, landed: torch.Tensor | None) -> None:
        self._inflight = None
        self.buffers.replicas.land(self, result, landed, has_data, divisor, outer_now)
        # After delivery: a replicated group's result is the accumulation buffer itself.
        if accum is self.buffers.scratch_grad or not self.buffers.placement.keep_grad_buffer:
            accum.free()

    def sum_into_main(self, result: torch.Tensor, has_data: bool, divisor: float) -> None:
        """Reduced gradients into the main grads (summing into unconsumed ones)."""
        b = self.buffers
        if b.main_grad_buffer is not None:
            b.main_grad_buffer.alloc()
        result = b.home.take(result, b.main_grad)
        with torch.no_grad():
            if has_data:
                for index, grad in enumerate(self.sharded_params):
                    if grad.grad is None:
                        b.main_view(b.main_grad, index).zero_()
                b.main_grad.add_(result, alpha=1.0 / divisor)
            elif views.same_start(result, b.main_grad):
                if divisor != 1.0:  # divided, not multiplied by the inverse, as FSDP2 does
                    b.main_grad.div_(divisor)
            elif divisor != 1.0:
                torch.div(result, divisor, out=b.main_grad)
            else:
                b.main_grad.copy_(result)

    def hand_over(self) -> None:
        """Hand the optimizer its ``.grad`` views of the main grads."""
        self.buffers.sync_optimizer_grad()
        for i, sp in enumerate(self.sharded_params):
            if self._used[i]:
                sp.grad = self.grad_dtensors[i]
            self._used[i] = False
        self.delivered += 1
