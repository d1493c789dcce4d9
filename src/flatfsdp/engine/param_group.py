"""One unit's parameters that share (dtype, requires_grad, placement): their flat
buffers and the three things done to them -- unshard, reshard, reduce gradients.

Buffers per group (N = W x S elements, S = each rank's chunk slots; see layout):

====================  ==========  ===========  ============  =================
buffer                replicated  optim        optim_grads   optim_grads_params
====================  ==========  ===========  ============  =================
model weights         N kept      N kept       N kept        S kept, N transient
main weights (fp32)   N           S            S             S
grad accumulation     N kept      N kept       N transient   N transient
main grads (fp32)     N           S            S             S
====================  ==========  ===========  ============  =================

Where two buffers hold the same dtype and range they are one tensor: fp32
training keeps no separate main copy (ZeRO-1/2 main weights are this rank's
chunks *inside* the kept model-weight buffer), and a kept gradient buffer's
own row doubles as the main grads. The optimizer sees each parameter as a
DTensor whose local tensor is its chunk of the main weights, placed
``Shard(dim)`` (torch.chunk's rule) or ``Replicate()``; its ``.grad`` views the
main grads the same way. The module computes with views of the unsharded buffer.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flatfsdp.engine import collectives, views
from flatfsdp.engine.buffer import FlatBuffer
from flatfsdp.engine.coalesce import GatherRequest, ReduceRequest
from flatfsdp.engine.gather import GatherPlan
from flatfsdp.engine.layout import build_group_layout
from flatfsdp.engine.offload import HostOffload, staged_on_device
from flatfsdp.engine.outer_shard import OuterShard
from flatfsdp.engine.placement import GroupPlacement, TensorParallelSpec
from flatfsdp.engine.precision import MixedPrecisionPolicy

DIRECT_MIN_BYTES = 256 << 10
"""Chunk slots this large are received straight into place; smaller ones travel
together and are copied out (a message costs ~0.1 ms on gloo here, copying
256 KiB about as much)."""


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


class ParamGroup:
    def __init__(self, slots: list[ParamSlot], *, placement: GroupPlacement, policy: MixedPrecisionPolicy,
                 device: torch.device, fill: bool = True, offload: HostOffload | None = None):
        """``fill=False``: the caller writes the main weights' chunks itself
        (the parameters' values are not read). ``offload``: the main weights
        and grads live in host memory (see offload.py)."""
        self.slots = slots
        self.params = [s.param for s in slots]
        """What the module computes with: the original parameters (their data
        made views of the unsharded buffer), or for tensor-parallel ones a
        DTensor of that view (built in _make_views)."""
        self.placement = placement
        self.mesh = placement.mesh
        self.pg = self.mesh.get_group()
        outer = placement.dp.outer
        self.outer_pg = outer.get_group() if outer is not None and outer.size() > 1 else None
        """HSDP: the replicas of this rank's chunks, across which reduced
        gradients are all-reduced (None: no replicas)."""
        self.index = self.pg.rank() if placement.sharded else 0
        """Which chunk this rank holds (0 when replicated)."""
        original = self.params[0].dtype
        self.trainable = self.params[0].requires_grad and original.is_floating_point
        self.offload = offload
        self.compute_device = device
        self.compute_dtype = policy.compute_dtype(original)
        # Frozen parameters keep their own dtype: nothing steps them, and their
        # DTensors (and checkpoints) must hold the values they were given.
        self.main_dtype = policy.main_dtype(original) if self.trainable else original
        self.reduce_dtype = policy.grad_reduce_dtype(original)
        itemsize = torch.empty((), dtype=self.compute_dtype).element_size()
        self.layout = build_group_layout([s.local_shape for s in slots], placement.world,
                                         [s.shard_dim for s in slots], direct_min_numel=DIRECT_MIN_BYTES // itemsize)
        self.outer_shard = OuterShard(self.layout, self.outer_pg, self.index) if placement.hybrid else None
        """HFSDP: the main weights and grads are this rank's piece of its chunks
        (see outer_shard); None: they are the chunks themselves."""
        self._inner_partial: torch.Tensor | None = None
        """HFSDP, reductions deferred: inner-reduced gradient chunks still to be
        reduce-scattered across the outer dimension."""
        self._pending_divisor = 1.0
        self.bound_optimizers: weakref.WeakSet = weakref.WeakSet()
        """Optimizers bound by fully_shard_optimizer that step these parameters."""
        self._written = 0
        self._delivered = 0
        self._synced: tuple | None = None
        self._unsharded = False
        self._accum: FlatBuffer | None = None
        self._inflight: ReduceRequest | None = None
        self._outer_due = False
        """The main grads hold sums over the shard mesh only: the all-reduce
        across replicas is still to come (HSDP with reductions deferred)."""
        self._used = [False] * len(self.params)
        self._allocate(device)
        if fill:
            self._fill_from_params()
        self._make_views()

    # ---- construction -------------------------------------------------------------------

    def _allocate(self, device: torch.device) -> None:
        place, shard, full = self.placement, self.layout.shard_numel, self.layout.unsharded_numel
        # Offloaded main weights never share memory with what the device computes with.
        same = self.main_dtype == self.compute_dtype and self.offload is None

        def main_buffer(numel: int) -> torch.Tensor:
            if self.offload is not None:
                return self.offload.empty(numel, self.main_dtype, device)
            return torch.empty(numel, dtype=self.main_dtype, device=device)
        self.unsharded = FlatBuffer(full, self.compute_dtype, device, name="model weights")
        self.model_local: torch.Tensor | None = None
        main_numel = shard if self.outer_shard is None else self.outer_shard.numel
        if self.outer_shard is not None:
            # The main weights are a piece of the chunks: never the same tensor.
            self.model_local = torch.empty(shard, dtype=self.compute_dtype, device=device)
            self.main = main_buffer(main_numel)
        elif not place.keep_model_weights:
            self.model_local = torch.empty(shard, dtype=self.compute_dtype, device=device)
            self.main = self.model_local if same else main_buffer(shard)
        else:
            self.main = self.unsharded.data if same else main_buffer(shard)
        # Replicated, S == N and the local layout is the unsharded one.
        self._main_in_unsharded = place.keep_model_weights and same
        self.grads = self.main_grad = self._main_grad_buffer = self._scratch_grad = None
        if self.trainable:
            self.grads = FlatBuffer(full, self.reduce_dtype, device, allocated=place.keep_grad_buffer,
                                    name="gradients")
            # A kept buffer's own row doubles as the main grads in one dtype.
            self._grads_aliased = (place.keep_grad_buffer and self.reduce_dtype == self.main_dtype
                                   and self.outer_shard is None and self.offload is None)
            if self._grads_aliased:
                self.main_grad = self.grads.data[self.index * shard:(self.index + 1) * shard]
            elif self.offload is not None:
                # Host memory is what offload spends instead: kept, not released between steps.
                self.main_grad = main_buffer(main_numel).zero_()
            else:
                # Its own buffer: released between steps once the optimizer
                # has dropped the grads (see release_consumed_grads).
                self._main_grad_buffer = FlatBuffer(main_numel, self.main_dtype, device, name="main grads")
                self.main_grad = self._main_grad_buffer.data.zero_()
            self._scratch_grad = FlatBuffer(full, self.reduce_dtype, device, allocated=False, name="scratch")
        self.gather_plan = None
        if place.sharded:
            source = self.unsharded.data if place.keep_model_weights else self.model_local
            self.gather_plan = GatherPlan(self.layout, self.index, self.unsharded.data, source,
                                          source_in_unsharded=place.keep_model_weights)

    def _in_place_collective(self, tensor: torch.Tensor, collective) -> None:
        """``collective(tensor)``, in place; an offloaded host tensor goes through the device."""
        if self.offload is None:
            collective(tensor)
        else:
            staged_on_device(tensor, self.compute_device, collective)

    def main_chunk(self, index: int) -> torch.Tensor:
        """This rank's chunk of parameter ``index`` in the main weights."""
        p = self.layout.params[index]
        if self._main_in_unsharded:
            return views.unsharded_chunk(self.main, p, self.index)
        return self._main_view(self.main, index)

    def _main_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s part of a main-weights-shaped buffer (main weights or main grads)."""
        if self.outer_shard is not None:
            return self.outer_shard.piece_view(flat, index)
        return views.local_chunk(flat, self.layout.params[index], self.index)

    def own_chunk_of(self, full: torch.Tensor, index: int) -> torch.Tensor:
        """This rank's chunk (HFSDP: piece) of a full-size value of parameter ``index``."""
        if self.outer_shard is not None:
            return self.outer_shard.piece_of(full, index, self.index)
        return views.chunk_of(full, self.layout.params[index], self.index)

    def _fill_from_params(self) -> None:
        """Main weights straight from the original values (fp32 main weights keep
        full precision even when compute is bf16); kept model weights too."""
        values = [_local_value(p) for p in self.params]
        with torch.no_grad():
            if self.placement.keep_model_weights:
                for p, value in zip(self.layout.params, values):
                    views.unsharded_param(self.unsharded.data, p).copy_(value)
            if not self._main_in_unsharded:
                for index, value in enumerate(values):
                    self.main_chunk(index).copy_(self.own_chunk_of(value, index))
            # Replicas must agree: the first replica's values win.
            if not self.placement.sharded and self.pg.size() > 1:
                self._in_place_collective(self.main, lambda t: torch.distributed.broadcast(t, group=self.pg,
                                                                                           group_src=0))
            if self.outer_pg is not None and self.outer_shard is None:
                self._in_place_collective(self.main, lambda t: torch.distributed.broadcast(t, group=self.outer_pg,
                                                                                           group_src=0))
        # Model weights are synced from the main weights before first use
        # (ZeRO-1/2 gather them, so every replica agrees).
        self._synced = None

    def _make_views(self) -> None:
        """Original parameters become views of the unsharded buffer; the
        optimizer-facing DTensors view the main weights' and grads' chunks."""
        self.sharded_params, self._grad_dtensors = [], []
        for index, (p, slot) in enumerate(zip(self.layout.params, self.slots)):
            self.params[index] = self._compute_param(index)
            mesh, placements, spec = self._dtensor_spec(index)
            local = DTensor.from_local(self.main_chunk(index), mesh, placements, **spec)
            self.sharded_params.append(nn.Parameter(local, requires_grad=self.trainable))
            if self.trainable:
                grad = self._main_view(self.main_grad, index)
                self._grad_dtensors.append(DTensor.from_local(grad, mesh, placements, **spec))
        if self.trainable:
            self._destinations: dict[int, list] = {}
            self._zero_plans: dict[int, tuple] = {}
        if not self.placement.keep_model_weights:
            self.unsharded.free()

    def _compute_param(self, index: int) -> nn.Parameter:
        view = views.unsharded_param(self.unsharded.data, self.layout.params[index])
        slot = self.slots[index]
        if slot.tp is None:
            param = self.params[index]
            param.data = view
            return param
        tp = slot.tp
        local = DTensor.from_local(view, tp.mesh, tp.placements, shape=tp.shape,
                                   stride=_contiguous_strides(tp.shape), run_check=False)
        return nn.Parameter(local, requires_grad=self.params[index].requires_grad)

    def _dtensor_spec(self, index: int) -> tuple:
        """(mesh, placements, from_local keywords) of parameter ``index``'s sharded DTensor."""
        p, slot = self.layout.params[index], self.slots[index]
        shape = slot.tp.shape if slot.tp is not None else torch.Size(p.shape)
        return (self.placement.dtensor_mesh(slot.fqn), self.placement.dtensor_placements(p, slot.tp),
                dict(shape=torch.Size(shape), stride=_contiguous_strides(shape), run_check=False))

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
        local = DTensor.from_local(self.main_chunk(index), mesh, placements, **spec)
        param.grad = None
        torch.utils.swap_tensors(param, nn.Parameter(local, requires_grad=param.requires_grad))
        self.sharded_params[index] = param

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
        delivered = 0 if len(self.bound_optimizers) else self._delivered
        return self._written, self.main._version, sum(p._version for p in self.sharded_params), delivered

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
        if not self.placement.keep_model_weights:
            if self.model_local is not self.main and not self._in_sync():
                with torch.no_grad():
                    if self.outer_shard is not None:
                        self.outer_shard.all_gather(self.main, self.model_local)  # once per optimizer step
                    else:
                        self.model_local.copy_(self.main, non_blocking=self.offload is not None)
                self._mark_synced()
            self.unsharded.alloc()
            return GatherRequest(self.gather_plan, self.pg)
        if self._in_sync():
            return None
        self._cast_main_into_model_weights()
        if not self.placement.sharded:
            self._mark_synced()
            return None
        return GatherRequest(self.gather_plan, self.pg, then=[self._mark_synced])

    def _cast_main_into_model_weights(self) -> None:
        """Kept model weights with a separate main copy: this rank's chunks, cast."""
        if self._main_in_unsharded:
            return
        with torch.no_grad():
            if not self.placement.sharded:
                self.unsharded.data.copy_(self.main)
                return
            torch._foreach_copy_([views.unsharded_chunk(self.unsharded.data, p, self.index)
                                  for p in self.layout.params],
                                 [self.main_chunk(i) for i in range(len(self.params))])

    def reshard(self) -> None:
        """Release the gathered weights (ZeRO-3 only; the others keep them)."""
        self._unsharded = False
        if not self.placement.keep_model_weights:
            self.unsharded.free()

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

    # ---- gradients ----------------------------------------------------------------------

    def accumulate_grads(self, include_unused: bool = False) -> bool:
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
        if not pairs and not include_unused:
            return False
        fresh = self._accum is None
        if fresh:
            self.wait_reduction()
            self._accum = self._pick_accumulation_buffer()
            self._accum.alloc()
        destinations = self._grad_destinations(self._accum)
        dst, src = [], []
        for i, grad in pairs:
            dst += destinations[i]
            src += views.grad_sources(_local_grad(grad, self.slots[i].tp), self.layout.params[i])
        with torch.no_grad():
            if fresh:
                self._zero_unwritten(self._accum, {i for i, _ in pairs})
            if dst:
                (torch._foreach_copy_ if fresh else torch._foreach_add_)(dst, src)
        for i, _ in pairs:
            self._used[i] = True
            self.params[i].grad = None
        if include_unused:  # a parameter frozen since sharding stays without a gradient (as in FSDP2)
            self._used = [used or p.requires_grad for used, p in zip(self._used, self.params)]
        return True

    def _grad_destinations(self, buffer: FlatBuffer) -> list:
        key = id(buffer)
        if key not in self._destinations:
            self._destinations[key] = [views.grad_destinations(buffer.data, self.layout, p)
                                       for p in self.layout.params]
        return self._destinations[key]

    def _zero_unwritten(self, buffer: FlatBuffer, written: set[int]) -> None:
        """Zero alignment gaps, padding and the slots of parameters that got no gradient."""
        key = id(buffer)
        if key not in self._zero_plans:
            flat, layout = buffer.data, self.layout
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
        if self._grads_aliased and self._main_grad_has_data():
            return self._scratch_grad
        return self.grads

    def _main_grad_has_data(self) -> bool:
        return any(sp.grad is not None for sp in self.sharded_params)

    def reduction_request(self, average: bool, divide_factor: float | None = None, hook=None, *,
                          all_reduce: bool = True, defer_to_step: bool = False) -> ReduceRequest | None:
        """Hand over the accumulated local gradients for reduction into the main
        grads (summing into what the optimizer has not consumed yet, as autograd
        would). The request is issued by the caller, perhaps coalesced.

        With replicas (HSDP) the reduced chunks are then all-reduced across
        them -- unless ``all_reduce`` is False (FSDP2's
        ``set_requires_all_reduce``), or ``defer_to_step`` and a bound optimizer
        will ask for it before stepping (``complete_reduction``): outer traffic
        once per optimizer step, however many microbatches."""
        if self._accum is None:
            return None
        accum, has_data = self._accum, self._main_grad_has_data()
        self._accum = None
        if not has_data:
            self._outer_due = False  # what was pending was dropped with the grads
        if self._main_grad_buffer is not None:
            self._main_grad_buffer.alloc()  # no-op unless released since the last step
        if divide_factor is not None:
            divisor = float(divide_factor)
        else:
            divisor = float(self.placement.dp.average_over) if average else 1.0
        if not self.placement.sharded:
            request = ReduceRequest("all_reduce", accum.data, accum.data, self.pg)
        else:
            direct = (not has_data and self.main_grad.dtype == self.reduce_dtype and self.outer_shard is None
                      and self.offload is None)
            result = self.main_grad if direct else torch.empty(
                self.layout.shard_numel, dtype=self.reduce_dtype, device=self.compute_device)
            request = ReduceRequest("reduce_scatter", accum.data, result, self.pg)
        outer_now = self.outer_pg is not None and all_reduce and not (defer_to_step and len(self.bound_optimizers))
        if outer_now and not self._outer_due and self.outer_shard is None:
            # Only this backward's sums lack the replicas': the request
            # all-reduces just them (coalesced with the rest of its bucket).
            request.outer = self.outer_pg
        # The callback names the output, not the request: a request holding a
        # closure over itself is a reference cycle, and its output (a fresh
        # shard-sized buffer for HFSDP and bf16 reductions) would then live
        # until Python's cycle collector ran, not until delivered.
        output = request.output
        request.then.append(lambda: self._finish_reduction(accum, output, has_data, divisor, outer_now))
        if hook is not None:
            request.then.append(lambda: hook(self.main_grad))
        self._inflight = request
        return request

    def complete_reduction(self) -> None:
        """Wait for the reduction in flight and do any all-reduce across
        replicas still owed: the main grads are then final."""
        self.wait_reduction()
        if self._inner_partial is not None:
            self._deliver(self._outer_reduce(), self._main_grad_has_data(), self._pending_divisor)
        if self._outer_due:
            self._outer_due = False
            self._all_reduce_main_grad_over_replicas()

    def _all_reduce_main_grad_over_replicas(self) -> None:
        self._in_place_collective(self.main_grad, lambda t: collectives.all_reduce(t, self.outer_pg).wait())

    def release_consumed_grads(self) -> None:
        """Free the sharded main grads once the optimizer has set every grad to
        None (``zero_grad()``): nothing reads them until the next reduction,
        which re-allocates and overwrites them. Between steps a ZeRO-2/3 rank
        then holds no gradient memory at all, as with autograd's own grads --
        it is the forward's activations that grads would otherwise sit beside."""
        if (self._main_grad_buffer is not None and self._inflight is None and self._accum is None
                and not self._main_grad_has_data()):
            self._main_grad_buffer.free()

    @property
    def reduction_in_flight(self) -> bool:
        return self._inflight is not None

    def wait_reduction(self) -> None:
        if self._inflight is not None:
            self._inflight.wait()

    def _finish_reduction(self, accum: FlatBuffer, result: torch.Tensor, has_data: bool, divisor: float,
                          outer_now: bool) -> None:
        self._inflight = None
        if self.outer_shard is None:
            self._deliver(result, has_data, divisor, outer_now)
        else:
            # HFSDP: sum inner-reduced chunks until the outer reduce-scatter is due.
            if self._inner_partial is None:
                self._inner_partial = result
            else:
                self._inner_partial.add_(result)
            self._pending_divisor = divisor
            if outer_now:
                self._deliver(self._outer_reduce(), self._main_grad_has_data(), divisor)
        # After delivery: a replicated group's result is the accumulation buffer itself.
        if accum is self._scratch_grad or not self.placement.keep_grad_buffer:
            accum.free()

    def _outer_reduce(self) -> torch.Tensor:
        """HFSDP: reduce-scatter the summed chunks across the outer dimension;
        returns this rank's piece (not yet divided)."""
        partial, self._inner_partial = self._inner_partial, None
        piece = torch.empty(self.outer_shard.numel, dtype=partial.dtype, device=partial.device)
        self.outer_shard.reduce_scatter(partial, piece)
        return piece

    def _deliver(self, result: torch.Tensor, has_data: bool, divisor: float, outer_now: bool = True) -> None:
        """Reduced gradients into the main grads (summing into unconsumed ones),
        then hand the optimizer its ``.grad`` views."""
        if self._main_grad_buffer is not None:
            self._main_grad_buffer.alloc()
        if self.offload is not None:
            result = result.to(self.main_grad.device)  # device -> host, once per reduction
        with torch.no_grad():
            if has_data:
                for index, grad in enumerate(self.sharded_params):
                    if grad.grad is None:
                        self._main_view(self.main_grad, index).zero_()
                self.main_grad.add_(result, alpha=1.0 / divisor)
            elif views.same_start(result, self.main_grad):
                if divisor != 1.0:  # divided, not multiplied by the inverse, as FSDP2 does
                    self.main_grad.div_(divisor)
            elif divisor != 1.0:
                torch.div(result, divisor, out=self.main_grad)
            else:
                self.main_grad.copy_(result)
        if self.outer_pg is not None and self.outer_shard is None:
            if outer_now and self._outer_due:
                # Earlier backwards' sums are in the main grads too: all-reduce the lot, once.
                self._all_reduce_main_grad_over_replicas()
            self._outer_due = not outer_now
        for i, sp in enumerate(self.sharded_params):
            if self._used[i]:
                sp.grad = self._grad_dtensors[i]
            self._used[i] = False
        self._delivered += 1

    # ---- accounting ---------------------------------------------------------------------

    @property
    def gathered_bytes(self) -> int:
        return self.unsharded.numel * self.unsharded.data.element_size()

    def persistent_bytes(self) -> int:
        """Bytes this rank holds in this group's buffers at the optimizer step:
        kept weights, main weights and main grads -- the rank's theoretical
        share. (ZeRO-2/3 main grads are released between steps once the
        optimizer has dropped them; they count here at their full size.)"""
        return sum(self.persistent_bytes_by_role().values())

    def persistent_bytes_by_role(self) -> dict[str, int]:
        """``persistent_bytes`` split by what the bytes are for: "main weights"
        (what the optimizer updates; when the model computes in the same dtype
        the model views these very bytes), "model weights" (a separate copy in
        the compute dtype), "gradients". A storage serving two roles counts
        once, under the first."""
        model = [self.model_local] if self.model_local is not None else []
        if self.placement.keep_model_weights:
            model.append(self.unsharded.data)
        grads: list[torch.Tensor] = []
        released = 0
        if self.trainable:
            if self._main_grad_buffer is not None and not self._main_grad_buffer.is_allocated:
                released = self.main_grad.numel() * self.main_grad.element_size()
            else:
                grads.append(self.main_grad)
            if self.placement.keep_grad_buffer:
                grads.append(self.grads.data)
        seen: dict[int, torch.UntypedStorage] = {}
        main_bytes = _distinct_storage_bytes([self.main], seen)
        model_bytes = _distinct_storage_bytes(model, seen)
        return {"main weights": main_bytes, "model weights": model_bytes,
                "gradients": _distinct_storage_bytes(grads, seen) + released}

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor this group holds between steps (some may alias)."""
        held = [self.main] + ([self.model_local] if self.model_local is not None else [])
        return held + ([self.main_grad] if self.trainable else []) + self.flat_buffers()

    def flat_buffers(self) -> list[torch.Tensor]:
        """The flat tensors whose storage this group frees and re-allocates in
        place (gathered weights, unsharded gradients, scratch, released main
        grads): a memory meter must re-read their size, no op announces it."""
        buffers = [self.unsharded, self.grads, self._main_grad_buffer, self._scratch_grad]
        return [b.data for b in buffers if b is not None]

    def allocated_bytes(self) -> int:
        """Bytes this group's buffers hold right now, transient ones included."""
        tensors = [self.unsharded.data, self.main]
        if self.model_local is not None:
            tensors.append(self.model_local)
        if self.trainable:
            tensors += [self.grads.data, self.main_grad, self._scratch_grad.data]
        return _distinct_storage_bytes(tensors)


def _local_value(param: torch.Tensor) -> torch.Tensor:
    return (param.to_local() if isinstance(param, DTensor) else param).detach()


def _local_grad(grad: torch.Tensor, tp: TensorParallelSpec | None) -> torch.Tensor:
    """A tensor-parallel parameter's gradient as its local tensor, placed as
    the parameter is (a partial sum is reduced over the tensor-parallel mesh first)."""
    if not isinstance(grad, DTensor):
        return grad
    if tp is not None and tuple(grad.placements) != tuple(tp.placements):
        grad = grad.redistribute(tp.mesh, tp.placements)
    return grad.to_local()


def _distinct_storage_bytes(tensors: list[torch.Tensor], seen: dict | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (aliases count once;
    so do storages already in ``seen``, which this adds to). Storages are told
    apart by identity, not address: fake tensors (the estimator's) have none."""
    seen = {} if seen is None else seen
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and id(storage) not in seen:
            seen[id(storage)] = storage  # kept alive, so its id is not reused meanwhile
            total += storage.nbytes()
    return total


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))
