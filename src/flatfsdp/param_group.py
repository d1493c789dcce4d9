"""One unit's parameters that share (dtype, requires_grad): their flat buffers
and the three things done to them -- unshard, reshard, reduce gradients.

Buffers per group (N = padded numel, S = N / world size):

====================  ==========  ===========  ============  =================
buffer                no_shard    optim        optim_grads   optim_grads_params
====================  ==========  ===========  ============  =================
model weights         N kept      N kept       N kept        S kept, N transient
main weights (fp32)   N           S            S             S
grad accumulation     N kept      N kept       N transient   N transient
main grads (fp32)     N           S            S             S
====================  ==========  ===========  ============  =================

Where two buffers hold the same dtype and range they are one tensor (fp32
training keeps no separate main copy). The optimizer sees each parameter as a
DTensor viewing its piece of the main weights; its ``.grad`` views the main
grads. Parameters the module computes with are views of the model-weight buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from flatfsdp import collectives
from flatfsdp.buffer import FlatBuffer
from flatfsdp.coalesce import GatherRequest, ReduceRequest
from flatfsdp.layout import build_layout
from flatfsdp.precision import MixedPrecisionPolicy
from flatfsdp.registry import weights_epoch
from flatfsdp.strategy import ShardingStrategy

ALIGN_ELEMENTS = 8
"""Each parameter starts at a multiple of 8 elements (16-32 bytes): aligned views
for vectorised kernels, at a padding cost of under 8 elements per parameter."""


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter is registered: every (module, attribute) that holds it."""

    fqn: str
    param: nn.Parameter
    locations: tuple[tuple[nn.Module, str], ...]
    keys: tuple[str, ...] = ()
    """The state-dict key of every location, relative to the unit."""


class ParamGroup:
    def __init__(self, slots: list[ParamSlot], *, strategy: ShardingStrategy, policy: MixedPrecisionPolicy,
                 mesh: DeviceMesh, device: torch.device):
        self.slots = slots
        self.params = [s.param for s in slots]
        self.shapes = [p.shape for p in self.params]
        self.strategy = strategy
        self.mesh = mesh
        self.pg = mesh.get_group()
        self.world, self.rank = self.pg.size(), self.pg.rank()
        self.layout = build_layout([p.numel() for p in self.params], self.world, ALIGN_ELEMENTS)
        original = self.params[0].dtype
        self.trainable = self.params[0].requires_grad and original.is_floating_point
        self.compute_dtype = policy.compute_dtype(original)
        self.main_dtype = policy.main_dtype(original) if self.trainable else self.compute_dtype
        self.reduce_dtype = policy.grad_reduce_dtype(original)
        self._unsharded = False
        self._accum: FlatBuffer | None = None
        self._inflight: ReduceRequest | None = None
        self._used = [False] * len(self.params)
        self._allocate(device)
        self._fill_from_params()
        self._make_views()
        self._main_version = (-1, -1) if self.strategy.shards_main_weights else self._weights_version()

    # ---- construction -------------------------------------------------------------------

    @property
    def local_range(self) -> tuple[int, int]:
        if not self.strategy.shards_main_weights:
            return 0, self.layout.padded_numel
        return self.layout.shard_range(self.rank)

    def _allocate(self, device: torch.device) -> None:
        n, (lo, hi) = self.layout.padded_numel, self.local_range
        zero3 = self.strategy.shards_model_weights
        self.model_full = FlatBuffer(n, self.compute_dtype, device, name="model weights")
        self.model_local = torch.empty(hi - lo, dtype=self.compute_dtype, device=device) if zero3 \
            else self.model_full.data[lo:hi]
        self.main = self.model_local if self.main_dtype == self.compute_dtype \
            else torch.empty(hi - lo, dtype=self.main_dtype, device=device)
        self.grad_full = self.main_grad = self._main_grad_buffer = None
        if self.trainable:
            kept = not self.strategy.shards_grads
            self.grad_full = FlatBuffer(n, self.reduce_dtype, device, allocated=kept, name="gradients")
            # no_shard / optim in one dtype: the kept buffer doubles as the main grads.
            self._grads_aliased = kept and self.reduce_dtype == self.main_dtype
            if self._grads_aliased:
                self.main_grad = self.grad_full.data[lo:hi]
            else:
                # Its own buffer: released between steps once the optimizer
                # has dropped the grads (see release_consumed_grads).
                self._main_grad_buffer = FlatBuffer(hi - lo, self.main_dtype, device, name="main grads")
                self.main_grad = self._main_grad_buffer.data.zero_()
            self._scratch_grad = FlatBuffer(n, self.reduce_dtype, device, allocated=False, name="scratch")

    def _fill_from_params(self) -> None:
        """Copy each parameter's owned piece into the main (and model) buffers."""
        lo, hi = self.local_range
        with torch.no_grad():
            self.model_full.data.zero_()
            for seg, p in zip(self.layout.segments, self.params):
                self.model_full.data[seg.offset:seg.end].copy_(p.detach().reshape(-1))
            if self.main is not self.model_local or self.strategy.shards_model_weights:
                # Main weights straight from the original values (fp32 main
                # weights keep full precision even when compute is bf16).
                full_main = torch.zeros(self.layout.padded_numel, dtype=self.main_dtype,
                                        device=self.main.device)
                for seg, p in zip(self.layout.segments, self.params):
                    full_main[seg.offset:seg.end].copy_(p.detach().reshape(-1))
                self.main.copy_(full_main[lo:hi])
                if self.model_local is not self.main:
                    self.model_local.copy_(self.main)
        # Replicas must agree: ZeRO-1/2 re-gather the model weights from the
        # shards before first use (the version below forces it); no_shard takes
        # rank 0's copy.
        if self.strategy == ShardingStrategy.NO_SHARD and self.world > 1:
            torch.distributed.broadcast(self.main, group=self.pg, group_src=0)
            if self.model_full.data is not self.main:
                self.model_full.data.copy_(self.main)

    def _make_views(self) -> None:
        """Original parameters become views of the model-weight buffer; the
        optimizer-facing DTensors view the main weights and grads."""
        lo, _ = self.local_range
        placement = Shard(0) if self.strategy.shards_main_weights else Replicate()
        self.sharded_params, self._grad_views, self._grad_dtensors = [], [], []
        for i, (seg, p) in enumerate(zip(self.layout.segments, self.params)):
            p.data = self.model_full.view(seg.offset, seg.end, self.shapes[i])
            a, b = self._local_piece(i)
            start, end = seg.offset + a - lo, seg.offset + b - lo
            local = DTensor.from_local(self._piece(self.main, start, end, i), self.mesh, [placement],
                                       **self._dtensor_spec(i))
            self.sharded_params.append(nn.Parameter(local, requires_grad=self.trainable))
            if self.trainable:
                self._grad_views.append(self.main_grad[start:end])
                self._grad_dtensors.append(DTensor.from_local(self._piece(self.main_grad, start, end, i),
                                                              self.mesh, [placement], **self._dtensor_spec(i)))
        if self.strategy.shards_model_weights:
            self.model_full.free()

    def _dtensor_spec(self, index: int) -> dict:
        """DTensors carry the parameter's true global shape, so code that looks at
        ``p.shape`` / ``p.ndim`` (weight-decay rules, logging) sees what it would
        unsharded. Sharded, the local tensor is the rank's flat piece -- fine for
        the elementwise math optimizers and norms do; see docs/contract.md."""
        shape = self.shapes[index]
        return dict(shape=shape, stride=_contiguous_strides(shape), run_check=False)

    def _piece(self, flat: torch.Tensor, start: int, end: int, index: int) -> torch.Tensor:
        # Replicated (no_shard), the piece is the whole parameter: give it its shape.
        piece = flat[start:end]
        return piece if self.strategy.shards_main_weights else piece.view(self.shapes[index])

    def _local_piece(self, index: int) -> tuple[int, int]:
        if not self.strategy.shards_main_weights:
            return 0, self.layout.segments[index].numel
        return self.layout.local_piece(index, self.rank)

    # ---- weights ------------------------------------------------------------------------

    @property
    def is_unsharded(self) -> bool:
        return self._unsharded

    def gather_request(self) -> GatherRequest | None:
        """Mark the group gathered and say what to all-gather for it (None:
        nothing to communicate -- already gathered, or the kept replica is current)."""
        if self._unsharded:
            return None
        self._unsharded = True
        if self.strategy.shards_model_weights:
            self._refresh_model_local()
            self.model_full.alloc()
            return GatherRequest(self.model_full.data, self.model_local, self.pg)
        if self._main_version == self._weights_version():
            return None
        self._refresh_model_local()
        if not self.strategy.shards_main_weights:
            self._main_version = self._weights_version()
            return None
        return GatherRequest(self.model_full.data, self.model_local, self.pg, then=[self._record_main_version])

    def _refresh_model_local(self) -> None:
        """After an optimizer step, cast the updated main weights into the model
        weights (a no-op when they are the same tensor)."""
        if self.model_local is not self.main and self._main_version != self._weights_version():
            with torch.no_grad():
                self.model_local.copy_(self.main)
            self._main_version = self._weights_version()

    def _weights_version(self) -> tuple[int, int]:
        """Changes whenever the main weights may have been written: an optimizer
        step over sharded parameters (the registry's epoch) or an in-place edit
        of a DTensor parameter (its version counter; DTensor updates its local
        tensor below autograd, so ``main``'s own counter does not move)."""
        return weights_epoch(), sum(p._version for p in self.sharded_params)

    def _record_main_version(self) -> None:
        self._main_version = self._weights_version()

    def reshard(self) -> None:
        """Release the gathered weights (ZeRO-3 only; the others keep them)."""
        self._unsharded = False
        if self.strategy.shards_model_weights:
            self.model_full.free()

    def use_unsharded_params(self) -> None:
        for slot in self.slots:
            for module, attr in slot.locations:
                module._parameters[attr] = slot.param

    def use_sharded_params(self) -> None:
        for slot, sharded in zip(self.slots, self.sharded_params):
            for module, attr in slot.locations:
                module._parameters[attr] = sharded

    # ---- gradients ----------------------------------------------------------------------

    def accumulate_grads(self) -> bool:
        """Move the gradients autograd left on the unsharded parameters into the
        flat accumulation buffer. Returns whether there were any."""
        if not self.trainable:
            return False
        pairs = [(i, p.grad) for i, p in enumerate(self.params) if p.grad is not None]
        if not pairs:
            return False
        fresh = self._accum is None
        if fresh:
            self.wait_reduction()
            self._accum = self._pick_accumulation_buffer()
            self._accum.alloc()
        views = [self._accum.view(self.layout.segments[i].offset, self.layout.segments[i].end,
                                  self.shapes[i]) for i, _ in pairs]
        grads = [g for _, g in pairs]
        with torch.no_grad():
            if fresh:
                self._zero_unwritten(set(i for i, _ in pairs))
                torch._foreach_copy_(views, grads)
            else:
                torch._foreach_add_(views, grads)
        for i, _ in pairs:
            self._used[i] = True
            self.params[i].grad = None
        return True

    def _pick_accumulation_buffer(self) -> FlatBuffer:
        # While the optimizer still holds grads in a buffer that doubles as the
        # accumulation buffer, a new microbatch accumulates aside.
        if self._grads_aliased and self._main_grad_has_data():
            return self._scratch_grad
        return self.grad_full

    def _zero_unwritten(self, written: set[int]) -> None:
        """Zero padding and the slots of parameters that got no gradient."""
        flat, cursor = self._accum.data, 0
        for i, seg in enumerate(self.layout.segments):
            if i in written:
                if seg.offset > cursor:
                    flat[cursor:seg.offset].zero_()
                cursor = seg.end
        if flat.numel() > cursor:
            flat[cursor:].zero_()

    def _main_grad_has_data(self) -> bool:
        return any(sp.grad is not None for sp in self.sharded_params)

    def reduction_request(self, average: bool) -> ReduceRequest | None:
        """Hand over the accumulated local gradients for reduction into the main
        grads (summing into what the optimizer has not consumed yet, as autograd
        would). The request is issued by the caller, perhaps coalesced."""
        if self._accum is None:
            return None
        accum, has_data = self._accum, self._main_grad_has_data()
        self._accum = None
        if self._main_grad_buffer is not None:
            self._main_grad_buffer.alloc()  # no-op unless released since the last step
        scale = 1.0 / self.world if average else 1.0
        if not self.strategy.shards_main_weights:
            request = ReduceRequest("all_reduce", accum.data, accum.data, self.pg)
        else:
            direct = not has_data and self.main_grad.dtype == self.reduce_dtype
            result = self.main_grad if direct else torch.empty(
                self.layout.shard_numel, dtype=self.reduce_dtype, device=self.main_grad.device)
            request = ReduceRequest("reduce_scatter", accum.data, result, self.pg)
        request.then.append(lambda: self._finish_reduction(accum, request.output, has_data, scale))
        self._inflight = request
        return request

    def release_consumed_grads(self) -> None:
        """Free the sharded main grads once the optimizer has set every grad to
        None (``zero_grad()``): nothing reads them until the next reduction,
        which re-allocates and overwrites them. Between steps a ZeRO-2/3 rank
        then holds no gradient memory at all, as with autograd's own grads --
        it is the forward's activations that grads would otherwise sit beside."""
        if (self._main_grad_buffer is not None and self._inflight is None and self._accum is None
                and not self._main_grad_has_data()):
            self._main_grad_buffer.free()

    def wait_reduction(self) -> None:
        if self._inflight is not None:
            self._inflight.wait()

    def _finish_reduction(self, accum: FlatBuffer, result: torch.Tensor, has_data: bool, scale: float) -> None:
        self._inflight = None
        with torch.no_grad():
            if has_data:
                for view, sp in zip(self._grad_views, self.sharded_params):
                    if sp.grad is None:
                        view.zero_()
                self.main_grad.add_(result, alpha=scale)
            elif result.data_ptr() == self.main_grad.data_ptr():
                if scale != 1.0:
                    self.main_grad.mul_(scale)
            else:
                torch.mul(result, scale, out=self.main_grad)
        for i, sp in enumerate(self.sharded_params):
            if self._used[i]:
                sp.grad = self._grad_dtensors[i]
            self._used[i] = False
        if accum is self._scratch_grad or self.strategy.shards_grads:
            accum.free()

    # ---- checkpoint views ---------------------------------------------------------------

    def piece_bounds(self, index: int) -> tuple[int, int]:
        """Where parameter ``index``'s local piece sits in this rank's main buffer."""
        a, b = self._local_piece(index)
        start = self.layout.segments[index].offset + a - self.local_range[0]
        return start, start + (b - a)

    def gather_full(self, pieces: list[torch.Tensor | None], dtype: torch.dtype) -> torch.Tensor:
        """The whole flat group (N elements) from every rank's pieces of every
        parameter (None: zeros). One all-gather, or none when replicated."""
        lo, hi = self.local_range
        local = torch.zeros(hi - lo, dtype=dtype, device=self.main.device)
        for index, piece in enumerate(pieces):
            if piece is not None:
                start, end = self.piece_bounds(index)
                local[start:end].copy_(piece.reshape(-1))
        if not self.strategy.shards_main_weights:
            return local
        full = torch.empty(self.layout.padded_numel, dtype=dtype, device=local.device)
        collectives.all_gather(full, local, self.pg).wait()
        return full

    def full_param(self, full: torch.Tensor, index: int) -> torch.Tensor:
        seg = self.layout.segments[index]
        return full[seg.offset:seg.end].view(self.shapes[index])

    def own_piece(self, full_param: torch.Tensor, index: int) -> torch.Tensor:
        """This rank's flat piece of a full-size value of parameter ``index``."""
        a, b = self._local_piece(index)
        return full_param.reshape(-1)[a:b]

    # ---- accounting ---------------------------------------------------------------------

    def persistent_bytes(self) -> int:
        """Bytes this rank holds in this group's buffers at the optimizer step:
        kept weights, main weights and main grads -- the rank's theoretical
        share. (ZeRO-2/3 main grads are released between steps once the
        optimizer has dropped them; they count here at their full size.)"""
        tensors = [self.model_local, self.main]
        if not self.strategy.shards_model_weights:
            tensors.append(self.model_full.data)
        released = 0
        if self.trainable:
            if self._main_grad_buffer is not None and not self._main_grad_buffer.is_allocated:
                released = self.main_grad.numel() * self.main_grad.element_size()
            else:
                tensors.append(self.main_grad)
            if not self.strategy.shards_grads:
                tensors.append(self.grad_full.data)
        return _distinct_storage_bytes(tensors) + released

    def allocated_bytes(self) -> int:
        """Bytes this group's buffers hold right now, transient ones included."""
        tensors = [self.model_full.data, self.model_local, self.main]
        if self.trainable:
            tensors += [self.grad_full.data, self.main_grad, self._scratch_grad.data]
        return _distinct_storage_bytes(tensors)


def _distinct_storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (aliases count once)."""
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        key = storage.data_ptr(), storage.nbytes()
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))
