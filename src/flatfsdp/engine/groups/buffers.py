"""The flat buffers of one param group, which of them are one tensor, and
what they hold on this rank.

Buffers per group (N = W x S elements, S = each rank's chunk slots; see
layout.arithmetic):

====================  ==========  ===========  ============  =================
buffer                replicated  optim        optim_grads   optim_grads_params
====================  ==========  ===========  ============  =================
model weights         N kept      N kept       N kept        S kept, N transient
main weights (fp32)   N           S            S             S
grad accumulation     N kept      N kept       N transient   N transient
main grads (fp32)     N           S            S             S
====================  ==========  ===========  ============  =================

Main grads narrower than the main weights (Megatron-FSDP's ``main_grads_dtype``)
add an S-sized copy in the main weights' dtype: what the optimizer reads.

Where two buffers hold the same dtype and range they are one tensor: fp32
training keeps no separate main copy (ZeRO-1/2 main weights are this rank's
chunks *inside* the kept model-weight buffer), and a kept gradient buffer's
own row doubles as the main grads. Two choices made once per group decide
the rest: its replica plan (groups/replicas.py: HFSDP's main weights and
grads are this rank's piece of its chunks) and its main weights' home
(layout/main_home.py: in host memory they never alias what the device
computes with).
"""

from __future__ import annotations

import torch

from flatfsdp.engine.groups.replicas import ReplicaPlan, replicas_for
from flatfsdp.engine.groups.wire_choice import WireChoice
from flatfsdp.engine.layout import views
from flatfsdp.engine.layout.arithmetic import GroupLayout
from flatfsdp.engine.layout.buffer import FlatBuffer
from flatfsdp.engine.layout.main_home import MainHome
from flatfsdp.engine.layout.placement import GroupPlacement


class GradientBuffers:
    """The gradient half every group has: the rank-major accumulation buffer,
    the sharded main grads (and a scratch buffer), the process groups they
    are reduced over and the codec that reduces them. Weight buffers differ
    by kind of group: ``GroupBuffers`` (flat) and subclass_buffers."""

    def __init__(self, layout: GroupLayout, placement: GroupPlacement, *, index: int, device: torch.device,
                 main_dtype: torch.dtype, reduce_dtype: torch.dtype, trainable: bool,
                 home: MainHome, wire: WireChoice, grads_dtype: torch.dtype | None = None):
        """``grads_dtype``: the main grads' (None: ``main_dtype``)."""
        self.layout, self.placement, self.index = layout, placement, index
        self.pg = placement.mesh.get_group()
        self.compute_device, self.home = device, home
        self.reduce_dtype = reduce_dtype
        self.wire = wire
        self.reduce_codec = wire.reduce_codec()
        """How gradients travel (comm/wire.py); a user's FSDP2 ReduceScatter may replace it."""
        self.replicas: ReplicaPlan = replicas_for(layout, placement, index, wire.transport)
        """How the replicas across the outer dimension relate (groups/replicas.py)."""
        self.grads = self.main_grad = self.main_grad_buffer = self.scratch_grad = None
        self.optim_grad: FlatBuffer | None = None
        """The main grads cast to the main weights' dtype, when they differ
        (``.grad`` views it); None: ``.grad`` views the main grads."""
        self.grads_aliased = False
        if trainable:
            self._allocate_grads(device, grads_dtype or main_dtype)
            if grads_dtype is not None and grads_dtype != main_dtype:
                self.optim_grad = FlatBuffer(self.main_numel, main_dtype, self.main_grad.device, name="optimizer grads")

    @property
    def main_numel(self) -> int:
        return self.replicas.main_numel

    def _allocate_grads(self, device: torch.device, main_dtype: torch.dtype) -> None:
        place, shard, full = self.placement, self.layout.shard_numel, self.layout.unsharded_numel
        self.grads = FlatBuffer(full, self.reduce_dtype, device, allocated=place.keep_grad_buffer, name="gradients")
        # A kept buffer's own row doubles as the main grads in one dtype.
        self.grads_aliased = (place.keep_grad_buffer and self.reduce_dtype == main_dtype
                              and not self.replicas.splits_main and self.home.shares_device_memory)
        if self.grads_aliased:
            self.main_grad = self.grads.data[self.index * shard:(self.index + 1) * shard]
        else:
            self.main_grad, self.main_grad_buffer = self.home.main_grads(self.main_numel, main_dtype, device)
        self.scratch_grad = FlatBuffer(full, self.reduce_dtype, device, allocated=False, name="scratch")

    def main_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s part of a main-weights-shaped buffer (main weights or main grads)."""
        return self.replicas.main_view(flat, index)

    def own_chunk_of(self, full: torch.Tensor, index: int) -> torch.Tensor:
        """This rank's chunk (HFSDP: piece) of a full-size value of parameter ``index``."""
        return self.replicas.own_chunk_of(full, index)

    def in_place_collective(self, tensor: torch.Tensor, collective) -> None:
        """``collective(tensor)``, in place (a host tensor goes through the device)."""
        self.home.in_place_collective(tensor, self.compute_device, collective)

    def persistent_bytes(self) -> int:
        """Bytes this rank holds in these buffers at the optimizer step: kept
        weights, main weights and main grads -- the rank's theoretical share.
        (ZeRO-2/3 main grads are released between steps once the optimizer
        has dropped them; they count here at their full size.)"""
        return sum(self.persistent_bytes_by_role().values())

    def _persistent_grads(self) -> tuple[list[torch.Tensor], int]:
        """The gradient tensors held between steps, and the bytes of released
        main grads (counted: the optimizer step brings them back)."""
        grads: list[torch.Tensor] = []
        released = 0
        if self.main_grad is not None:
            if self.main_grad_buffer is not None and not self.main_grad_buffer.is_allocated:
                released = self.main_grad.numel() * self.main_grad.element_size()
            else:
                grads.append(self.main_grad)
            if self.placement.keep_grad_buffer:
                grads.append(self.grads.data)
            if self.optim_grad is not None:
                if self.optim_grad.is_allocated:
                    grads.append(self.optim_grad.data)
                else:
                    released += self.optim_grad.numel * self.optim_grad.data.element_size()
        return grads, released

    def _grad_buffers(self) -> list[torch.Tensor]:
        """The flat gradient tensors whose storage comes and goes."""
        return [b.data for b in (self.grads, self.main_grad_buffer, self.scratch_grad, self.optim_grad)
                if b is not None]

    def _grad_tensors(self) -> list[torch.Tensor]:
        if self.main_grad is None:
            return []
        optim = [self.optim_grad.data] if self.optim_grad is not None else []
        return [self.grads.data, self.main_grad, self.scratch_grad.data] + optim

    def optimizer_grad(self) -> torch.Tensor:
        """What the optimizer's ``.grad`` views: the main grads, or their cast copy."""
        return self.optim_grad.data if self.optim_grad is not None else self.main_grad

    def sync_optimizer_grad(self) -> None:
        """Cast the main grads into the optimizer's copy (where there is one)."""
        if self.optim_grad is not None:
            self.optim_grad.alloc()
            self.optim_grad.data.copy_(self.main_grad)


class GroupBuffers(GradientBuffers):
    """A group's flat buffers, allocated once for its lifetime (the transient
    ones are ``FlatBuffer``s whose storage comes and goes; the tensors stay)."""

    def __init__(self, layout: GroupLayout, placement: GroupPlacement, *, index: int, device: torch.device,
                 compute_dtype: torch.dtype, main_dtype: torch.dtype, reduce_dtype: torch.dtype,
                 trainable: bool, home: MainHome, wire: WireChoice,
                 grads_dtype: torch.dtype | None = None):
        """``wire``: how the weights and gradients travel (groups/wire_choice.py);
        ``grads_dtype``: the main grads' (None: ``main_dtype``)."""
        super().__init__(layout, placement, index=index, device=device, main_dtype=main_dtype,
                         reduce_dtype=reduce_dtype, trainable=trainable, home=home, wire=wire,
                         grads_dtype=grads_dtype)
        self._allocate_weights(device, compute_dtype, main_dtype)
        self._early_source = None
        self.gather_codec = wire.gather_codec(self)
        """How the weights travel (comm/wire.py; None: replicated, nothing does).
        A user's FSDP2 AllGather may wrap it."""

    def _allocate_weights(self, device: torch.device, compute_dtype: torch.dtype, main_dtype: torch.dtype) -> None:
        place, shard = self.placement, self.layout.shard_numel
        # Host main weights never share memory with what the device computes with.
        same = main_dtype == compute_dtype and self.home.shares_device_memory
        self.unsharded = FlatBuffer(self.layout.unsharded_numel, compute_dtype, device, name="model weights")
        self.model_local: torch.Tensor | None = None
        if self.wire.gathers_codes:
            # Gathered from codes made of the main weights: no compute-dtype
            # shard, and kept weights hold dequantized values, never the main ones.
            self.main = self.home.empty(self.main_numel, main_dtype, device)
            self.main_in_unsharded = False
            return
        if self.replicas.splits_main:
            # The main weights are a piece of the chunks: never the same tensor.
            self.model_local = torch.empty(shard, dtype=compute_dtype, device=device)
            self.main = self.home.empty(self.main_numel, main_dtype, device)
        elif not place.keep_model_weights and self.holds_whole_group():
            # Nothing travels (comm/cast_gather.py): in one dtype the gathered buffer *is* the
            # main weights, never released; in two, each gather casts the main weights into it.
            self.main = self.unsharded.data if same else self.home.empty(shard, main_dtype, device)
        elif not place.keep_model_weights:
            self.model_local = torch.empty(shard, dtype=compute_dtype, device=device)
            self.main = self.model_local if same else self.home.empty(shard, main_dtype, device)
        else:
            self.main = self.unsharded.data if same else self.home.empty(shard, main_dtype, device)
        # Replicated, S == N and the local layout is the unsharded one.
        self.main_in_unsharded = same and (place.keep_model_weights or self.holds_whole_group())

    def holds_whole_group(self) -> bool:
        """A shard group of one rank, main weights on the device: under ZeRO-3
        nothing needs gathering, so no compute-dtype chunk is kept for a gather
        to send (16 bytes a parameter in bf16, as FSDP2's, not 18)."""
        return self.layout.world == 1 and not self.replicas.splits_main and self.home.shares_device_memory

    @property
    def gathered_is_main(self) -> bool:
        """The gathered buffer is the main weights themselves: never released."""
        return self.main_in_unsharded and not self.placement.keep_model_weights

    def refresh_early(self) -> None:
        """Start bringing the compute-dtype chunks up to date where the
        replicas must help (HFSDP: every replica's piece of the updated
        weights, gathered across the outer dimension now -- a slow inter-node
        link: it travels while earlier units compute); ``refresh_gather_source``
        waits for it."""
        if self.model_local is not None and self._early_source is None:
            with torch.no_grad():
                self._early_source = self.replicas.gather_source(self.main, self.model_local)

    def refresh_gather_source(self) -> None:
        """What a plain gather sends, from the main weights (once per optimizer
        step): ZeRO-3's compute-dtype shard (HFSDP: gathered across the outer
        dimension), or this rank's chunks of the kept unsharded buffer, cast."""
        with torch.no_grad():
            if self.model_local is not None:
                self.refresh_early()
                self._early_source, pending = None, self._early_source
                if pending is not None:
                    pending.wait()
                elif self.model_local is not self.main:
                    self.home.copy_(self.model_local, self.main)
            elif not self.main_in_unsharded:
                torch._foreach_copy_([views.unsharded_chunk(self.unsharded.data, p, self.index)
                                      for p in self.layout.params],
                                     [self.main_chunk(i) for i in range(len(self.layout.params))])

    def refresh_replica(self) -> None:
        """A replicated group's kept weights from its main weights (when they are two tensors)."""
        if not self.main_in_unsharded:
            with torch.no_grad():
                self.unsharded.data.copy_(self.main)

    # ---- one parameter's part -----------------------------------------------------------

    def main_chunk(self, index: int) -> torch.Tensor:
        """This rank's chunk of parameter ``index`` in the main weights."""
        p = self.layout.params[index]
        if self.main_in_unsharded:
            return views.unsharded_chunk(self.main, p, self.index)
        return self.main_view(self.main, index)

    def main_tensors(self) -> list[torch.Tensor]:
        """The plain tensors the main weights are (what a broadcast sends)."""
        return [self.main]

    # ---- accounting ---------------------------------------------------------------------

    @property
    def gathered_bytes(self) -> int:
        return self.unsharded.numel * self.unsharded.data.element_size()

    def persistent_bytes_by_role(self) -> dict[str, int]:
        """``persistent_bytes`` split by what the bytes are for: "main weights"
        (what the optimizer updates; when the model computes in the same dtype
        the model views these very bytes), "model weights" (a separate copy in
        the compute dtype), "gradients". A storage serving two roles counts
        once, under the first."""
        model = [self.model_local] if self.model_local is not None else []
        if self.placement.keep_model_weights:
            model.append(self.unsharded.data)
        model += self._codec_held()  # e.g. the step's codes: this rank's row
        grads, released = self._persistent_grads()
        seen: dict[int, torch.UntypedStorage] = {}
        main_bytes = _distinct_storage_bytes([self.main], seen)
        model_bytes = _distinct_storage_bytes(model, seen)
        return {"main weights": main_bytes, "model weights": model_bytes,
                "gradients": _distinct_storage_bytes(grads, seen) + released}

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor held between steps (some may alias)."""
        held = [self.main] + ([self.model_local] if self.model_local is not None else [])
        held += self._codec_held()
        return held + ([self.main_grad] if self.main_grad is not None else []) + self.flat_buffers()

    def flat_buffers(self) -> list[torch.Tensor]:
        """The flat tensors whose storage is freed and re-allocated in place
        (gathered weights, unsharded gradients, scratch, released main grads):
        a memory meter must re-read their size, no op announces it."""
        return [self.unsharded.data] + self._grad_buffers()

    def allocated_bytes(self) -> int:
        """Bytes these buffers hold right now, transient ones included."""
        tensors = [self.unsharded.data, self.main] + self._codec_held()
        if self.model_local is not None:
            tensors.append(self.model_local)
        return _distinct_storage_bytes(tensors + self._grad_tensors())

    def _codec_held(self) -> list[torch.Tensor]:
        return self.gather_codec.held() if self.gather_codec is not None else []


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
