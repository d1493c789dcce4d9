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

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flatfsdp.engine.comm import lookup_rows
from flatfsdp.engine.comm.coalesce import GatherRequest
from flatfsdp.engine.comm.gather import GatherPlan
from flatfsdp.engine.comm.paced_gather import PacedGather
from flatfsdp.engine.comm.wire import PlainReduce
from flatfsdp.engine.groups.buffers import GroupBuffers
from flatfsdp.engine.groups.gradients import GroupGradients
from flatfsdp.engine.groups.group_core import GroupCore
from flatfsdp.engine.groups.group_tensors import GroupTensors
from flatfsdp.engine.groups.slots import ParamSlot, contiguous_strides, local_value
from flatfsdp.engine.groups.wire_choice import WireChoice
from flatfsdp.engine.layout import views
from flatfsdp.engine.layout.arithmetic import build_group_layout
from flatfsdp.engine.layout.local_dtensor import dtensor_over
from flatfsdp.engine.layout.main_home import DEVICE, MainHome
from flatfsdp.engine.layout.placement import GroupPlacement
from flatfsdp.engine.layout.precision import MixedPrecisionPolicy
from flatfsdp.engine.layout.switches import Transport

DIRECT_MIN_BYTES = 256 << 10
"""Chunk slots this large are received straight into place; smaller ones travel
together and are copied out (a message costs ~0.1 ms on gloo here, copying
256 KiB about as much)."""


class ParamGroup(GroupCore):
    def __init__(self, slots: list[ParamSlot], *, placement: GroupPlacement, policy: MixedPrecisionPolicy,
                 device: torch.device, transport: Transport, fill: bool = True, home: MainHome = DEVICE):
        """``fill=False``: the caller writes the main weights' chunks itself
        (the parameters' values are not read). ``home``: where the main
        weights and grads live (layout/main_home.py). ``transport``: how
        collectives move bytes (layout/switches.py)."""
        super().__init__(slots, placement, device)
        self.slots = slots
        self.params = [s.param for s in slots]
        """What the module computes with: the original parameters (their data
        made views of the unsharded buffer), or for tensor-parallel ones a
        DTensor of that view (built in _make_views)."""
        original = self.params[0].dtype
        self.home = home
        self.compute_dtype = policy.compute_dtype(original)
        # Frozen parameters keep their own dtype: nothing steps them, and their
        # DTensors (and checkpoints) must hold the values they were given.
        self.main_dtype = policy.main_dtype(original) if self.trainable else original
        self.reduce_dtype = policy.reduction_dtype(original)
        itemsize = torch.empty((), dtype=self.compute_dtype).element_size()
        self.layout = build_group_layout([s.local_shape for s in slots], placement.world,
                                         [s.shard_dim for s in slots], direct_min_numel=DIRECT_MIN_BYTES // itemsize)
        wire = WireChoice.for_group(policy, transport, sharded=placement.sharded,
                                    floating=self.compute_dtype.is_floating_point, trainable=self.trainable,
                                    home=home, name=slots[0].fqn)
        self.buffers = GroupBuffers(self.layout, placement, index=self.index, device=device,
                                    compute_dtype=self.compute_dtype, main_dtype=self.main_dtype,
                                    reduce_dtype=self.reduce_dtype, trainable=self.trainable, home=home,
                                    wire=wire, grads_dtype=policy.grads_dtype(original) if self.trainable else None)
        self.faces: list[tuple[int, nn.Parameter]] = []
        """(parameter index, leaf) registered where a row-lookup table is used
        by a module that is not an embedding (see ``install_faces``)."""
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
            if self.placement.keep_model_weights or b.main_in_unsharded:
                for p, value in zip(self.layout.params, values):
                    views.unsharded_param(b.unsharded.data, p).copy_(value)
            if not b.main_in_unsharded:
                for index, value in enumerate(values):
                    b.main_chunk(index).copy_(b.own_chunk_of(value, index))
        # Replicas must agree: the first replica's values win.
        self.broadcast_from_first_replica()
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
            mesh, placements, spec = self.dtensor_spec(index)
            local = dtensor_over(b.main_chunk(index), mesh, placements, **spec)
            self.sharded_params.append(nn.Parameter(local, requires_grad=self.trainable))
            if self.trainable:
                grad = b.main_view(b.optimizer_grad(), index)
                grad_dtensors.append(dtensor_over(grad, mesh, placements, **spec))
        if not self.placement.keep_model_weights and not b.gathered_is_main:
            b.unsharded.free()
        return GroupGradients(b, self.slots, self.params, self.sharded_params, grad_dtensors, self.bound_optimizers,
                              faces=self.faces)

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
        mesh, placements, spec = self.dtensor_spec(index)
        local = dtensor_over(self.buffers.main_chunk(index), mesh, placements, **spec)
        param.grad = None
        torch.utils.swap_tensors(param, nn.Parameter(local, requires_grad=param.requires_grad))
        self.sharded_params[index] = param

    def originals(self) -> list[nn.Parameter]:
        """The parameters as the user built them (their data now views the buffers)."""
        return [s.param for s in self.slots]

    def tensors(self) -> GroupTensors:
        """The group's own flat tensors (groups/group_tensors.py)."""
        b, place = self.buffers, self.placement
        kept = place.keep_model_weights or b.model_local is None
        return GroupTensors(
            model_weights=b.unsharded.data if kept else b.model_local, model_weights_sharded=not kept,
            main_weights=b.main, main_in_model_weights=b.main_in_unsharded, main_grads=b.main_grad,
            sharded=place.sharded, process_group=b.pg, rank_index=self.index, world=place.world,
            compute_dtype=self.compute_dtype, main_dtype=self.main_dtype, engine_storage=True,
            layout=self.layout, main_view=b.main_view)

    # ---- weights ------------------------------------------------------------------------

    def _storage_version(self) -> int:
        return self.buffers.main._version  # a plain in-place write into the main buffer

    def gather_request(self) -> GatherRequest | None:
        """Mark the group gathered and say what to all-gather for it (None:
        nothing to communicate -- already gathered, replicated, or the kept
        copy is current)."""
        if self._unsharded:
            return None
        self._unsharded = True
        b, kept = self.buffers, self.placement.keep_model_weights
        if self.in_sync():
            if kept:
                return None
        else:
            # Once per optimizer step, however many gathers.
            if b.gather_codec is not None:
                b.gather_codec.refresh()
            else:
                b.refresh_replica()
            if not kept:
                self.mark_synced()
        if not kept:
            b.unsharded.alloc()
        if b.gather_codec is None:  # replicated: nothing travels
            self.mark_synced()
            return None
        return GatherRequest(b.gather_codec, b.pg, then=[self.mark_synced] if kept else [])

    def rows_refusal(self) -> str | None:
        """Why ``gather_rows`` cannot serve this group (None: it can): one
        parameter, chunked on dim 0, gathered plainly from a ZeRO-3 shard."""
        codec = self.buffers.gather_codec
        if len(self.params) != 1:
            return f"its group holds {len(self.params)} parameters, not one table"
        if not isinstance(codec, GatherPlan) or codec.source_in_unsharded:
            return ("its weights are not gathered plainly from a ZeRO-3 shard (replicated, kept gathered "
                    "by ZeRO-1/2, low-bit codes or a custom all-gather)")
        if self.layout.params[0].shard_dim != 0:
            return f"its table is chunked on dim {self.layout.params[0].shard_dim}, not 0"
        return None

    def gather_rows(self, ids: torch.Tensor) -> None:
        """Mark the group gathered, with only the rows ``ids`` (on any rank)
        hold current in the unsharded buffer (comm/lookup_rows.py); if already
        gathered, only note the rows. For an embedding's forward, which reads nothing else."""
        b = self.buffers
        if self._unsharded:  # gathered whole: every row is here; the rows still count for the reduction
            self.note_rows(lookup_rows.union_of_ids(ids, b.pg, b.gather_codec.transport))
            return
        self._unsharded = True
        if not self.in_sync():
            b.gather_codec.refresh()
            self.mark_synced()
        b.unsharded.alloc()
        self.note_rows(lookup_rows.gather_rows(b.gather_codec, 0, ids, b.pg))

    def gather_paced(self, slices: int, label: str) -> PacedGather:
        """After ``gather_rows`` (the source current): the whole table, in
        ``slices`` slices its caller posts one at a time (comm/paced_gather.py)."""
        b = self.buffers
        self._unsharded = True
        b.unsharded.alloc()
        return PacedGather(b.gather_codec, 0, b.pg, slices, label)

    def forget_rows(self) -> None:
        """Only looked-up rows are current in the unsharded buffer and another
        module of the unit needs the whole table: the next ``gather_request``
        gathers it whole (into the same storage, the source already current)."""
        self._unsharded = False

    def note_rows(self, rows: torch.Tensor) -> None:
        """The table's gradient will be nonzero in ``rows`` (too): a row
        reduction, where the group reduces rows only, sends them."""
        if isinstance(self.buffers.reduce_codec, lookup_rows.RowsReduce):
            self.buffers.reduce_codec.note_rows(rows)

    def reduce_rows_only(self, on: bool) -> None:
        """Reduce the table's gradient as the rows its lookups touched
        (comm/lookup_rows.RowsReduce) -- where gradients travel plainly; the
        dense reduction otherwise."""
        b = self.buffers
        if on and type(b.reduce_codec) is PlainReduce and self.placement.sharded:
            b.reduce_codec = lookup_rows.RowsReduce(b.reduce_codec, self.layout, 0, self.index)
        elif not on and isinstance(b.reduce_codec, lookup_rows.RowsReduce):
            b.reduce_codec = b.reduce_codec.plain
            self.faces.clear()  # a plain table: its users' gradients are one again

    def refresh_early(self) -> None:
        """A new step begins: start what bringing the gathered weights up to date
        needs from other ranks (HFSDP's outer gather), if they are stale and
        nothing gathers them yet; the group's gather waits for it. Every rank
        decides alike (the stamp moves with the same steps everywhere)."""
        codec = self.buffers.gather_codec
        if codec is not None and not self._unsharded and not self.in_sync():
            codec.refresh_early()

    def reshard(self, free_storage: bool = True, keep_codes: bool = False) -> None:
        """Release the gathered weights (ZeRO-3 only; the others keep them).
        ``free_storage=False`` keeps their storage allocated (FSDP2's
        ``set_keep_unsharded_storage``): the next gather lands at the same address.
        ``keep_codes``: a training forward ends and its backward will gather
        again; low-bit codes stay held for it (Note [kept codes])."""
        self._unsharded = False
        if self.buffers.gather_codec is not None:
            self.buffers.gather_codec.release(keep_rows=keep_codes)
        if free_storage and not self.placement.keep_model_weights and not self.buffers.gathered_is_main:
            self.buffers.unsharded.free()

    def use_unsharded_params(self) -> None:
        self.install(self.params)

    def install_faces(self) -> None:
        """A row-lookup table that a module other than an embedding also
        registers (a tied output head) gets a leaf of its own there, viewing
        the same gathered storage, until the next release. Autograd then
        delivers that module's gradient on its own, when its backward makes
        it: reduced dense and early, apart from the lookup's, which is nonzero
        only in the looked-up rows and reduced as those rows, last
        (comm/lookup_rows.RowsReduce). The faces outlive the release: their
        gradients arrive in backward."""
        self.faces.clear()
        if not isinstance(self.buffers.reduce_codec, lookup_rows.RowsReduce):
            return
        for index, slot in enumerate(self.slots):
            param = self.params[index]
            for module, attr in slot.locations:
                if not isinstance(module, nn.Embedding):
                    face = nn.Parameter(param.detach(), requires_grad=param.requires_grad)
                    module._parameters[attr] = face
                    self.faces.append((index, face))

    def grad_leaves(self) -> list[nn.Parameter]:
        return self.params + [face for _, face in self.faces] if self.faces else self.params
