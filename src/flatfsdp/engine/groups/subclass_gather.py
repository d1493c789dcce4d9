"""Gathering parameters whose class gathers itself: FSDP2's all-gather extension.

A tensor subclass may implement

* ``fsdp_pre_all_gather(mesh)`` (or ``(mesh, orig_size, orig_stride, module,
  mp_policy)``) on its sharded local tensor, returning ``(inputs, metadata)``:
  the plain tensors to all-gather (float8 data; NF4 codes and scales) and
  what the rebuild needs besides;
* ``fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None)``,
  turning the gathered outputs back into the tensor the module computes
  with: the first time it returns ``(tensor, inner tensors)``; afterwards it
  is passed that tensor as ``out=`` and must find the new values in the same
  output storage.

Note [subclass gathers as bytes]: the inputs may be of several dtypes, some
of which a backend cannot all-gather (gloo has no float8). They travel as the
bytes of one row per rank, each input at a 16-byte aligned offset, and are
copied out of the gathered table into each output tensor. The outputs are
allocated once and their storage is released and re-allocated around each
use (as the flat buffers are), so ``out=`` always sees the same storage and
autograd's saved references stay valid. The copy-out costs a pass over bytes
that are already low-bit; the gain is one collective for any mix of dtypes on
any backend.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from flatfsdp.engine.comm.collectives import Pending
from flatfsdp.engine.groups.slots import contiguous_strides
from flatfsdp.engine.layout.device import SideStream
from flatfsdp.engine.layout.switches import Transport

BYTE_ALIGN = 16
"""Each input's offset in a rank's row: any dtype can be viewed there."""


def has_gather_protocol(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "fsdp_pre_all_gather") and hasattr(tensor, "fsdp_post_all_gather")


def inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a (possibly nested) wrapper subclass holds, for accounting."""
    if not hasattr(tensor, "__tensor_flatten__"):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [t for name in names for t in inner_tensors(getattr(tensor, name))]


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _free(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    if storage.nbytes():
        storage.resize_(0)


def _alloc(t: torch.Tensor, nbytes: int) -> None:
    storage = t.untyped_storage()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


class SubclassGatherPlan:
    """Gathers one group's protocol parameters as one byte row per rank: a
    gather codec (comm/wire.py) that always travels packed."""

    travels_alone = False
    dtype = torch.uint8

    def __init__(self, *, mesh, world: int, shapes: list[torch.Size], modules: list[nn.Module],
                 mp_policy, param_dtypes: list[torch.dtype], requires_grad: list[bool], device: torch.device,
                 transport: Transport, locals_: Callable[[], list[torch.Tensor]]):
        """``locals_()``: the sharded parameters' local tensors, read afresh at
        each gather (``refresh`` runs their pre-all-gathers)."""
        self.mesh, self.world, self.device = mesh, world, device
        self.transport, self._locals = transport, locals_
        self.shapes, self.modules, self.mp_policy = shapes, modules, mp_policy
        self.param_dtypes, self.requires_grad = param_dtypes, requires_grad
        self.every = list(range(len(shapes)))
        self.unsharded: list[nn.Parameter | None] = [None] * len(shapes)
        """What the module computes with, made by the first post-all-gather and reused after."""
        self._outputs: list[list[torch.Tensor]] = [[] for _ in shapes]
        self._output_bytes: list[list[int]] = [[] for _ in shapes]
        self._inner: list[tuple[torch.Tensor, ...]] = [() for _ in shapes]
        self._inner_bytes: list[list[int]] = [[] for _ in shapes]
        self._inputs: list[list[torch.Tensor]] = []
        self._metadata: list = []
        self._owners: list[torch.Tensor] = []
        self._sizes: list[list[torch.Size]] = []
        self._offsets: list[list[int]] = []
        self.row_bytes = 0
        """Bytes of one rank's row (set by ``prepare``; equal on every rank)."""

    @property
    def nbytes(self) -> int:
        """Bytes the gather moves into every rank: what the account counts."""
        return self.world * self.row_bytes

    # ---- the codec's face (comm/wire.py) -------------------------------------------------

    def refresh(self) -> None:
        """Before every gather: the subclass decides what travels each time."""
        self.prepare(self._locals())

    def refresh_early(self) -> None:
        """The pre-all-gathers run at the gather itself (their inputs may change until then)."""

    def local_result(self) -> Pending | None:
        return None

    def issue_alone(self, group: dist.ProcessGroup, *, async_op: bool,
                    stream: SideStream | None) -> Pending | None:
        return None

    def release(self, keep_rows: bool) -> None:
        """The outputs' storage is released by ``free`` (kept for FSDP2's keep_unsharded_storage)."""

    def held(self) -> list[torch.Tensor]:
        return []

    # ---- before the collective ------------------------------------------------------------

    def prepare(self, locals_: list[torch.Tensor]) -> None:
        """Run each sharded local tensor's pre-all-gather; lay out the row."""
        self._inputs, self._metadata, self._sizes, self._offsets = [], [], [], []
        self._owners = list(locals_)  # whose post-all-gather rebuilds each parameter
        cursor = 0
        for index, local in enumerate(locals_):
            inputs, metadata = self._pre_all_gather(index, local)
            inputs = [t.contiguous() for t in inputs]
            offsets = []
            for t in inputs:
                offsets.append(cursor)
                cursor = _round_up(cursor + _nbytes(t), BYTE_ALIGN)
            self._inputs.append(inputs)
            self._metadata.append(metadata)
            self._sizes.append([t.size() for t in inputs])
            self._offsets.append(offsets)
            self._ensure_outputs(index, inputs)
        self.row_bytes = cursor

    def _pre_all_gather(self, index: int, local: torch.Tensor):
        hook = local.fsdp_pre_all_gather
        arity = len(inspect.signature(hook).parameters)
        if arity == 1:
            return hook(self.mesh)
        if arity == 5:
            shape = self.shapes[index]
            return hook(self.mesh, shape, contiguous_strides(tuple(shape)), self.modules[index], self.mp_policy)
        raise TypeError(f"{type(local).__name__}.fsdp_pre_all_gather takes {arity} arguments; FSDP2's protocol "
                        "is (mesh) or (mesh, orig_size, orig_stride, module, mp_policy)")

    def _ensure_outputs(self, index: int, inputs: list[torch.Tensor]) -> None:
        """Allocate (first gather) or re-allocate (later ones) the outputs, and
        the tensors the rebuilt parameter holds."""
        if not self._outputs[index]:
            self._outputs[index] = [torch.empty(self.world * t.numel(), dtype=t.dtype, device=self.device)
                                    for t in inputs]
            self._output_bytes[index] = [_nbytes(t) for t in self._outputs[index]]
            return
        for t, nbytes in zip(self._outputs[index], self._output_bytes[index]):
            _alloc(t, nbytes)
        for t, nbytes in zip(self._inner[index], self._inner_bytes[index]):
            _alloc(t, nbytes)

    # ---- the byte row -------------------------------------------------------------------

    def pack(self, row: torch.Tensor) -> None:
        """This rank's inputs, as bytes, into its row."""
        for i in self.every:
            for t, offset in zip(self._inputs[i], self._offsets[i]):
                row[offset:offset + _nbytes(t)].copy_(t.view(-1).view(torch.uint8))
        self._inputs = []

    def unpack(self, table: torch.Tensor) -> None:
        """Every rank's inputs from the gathered (world, row) table into the
        outputs, rank-major; then each parameter's post-all-gather."""
        for i in self.every:
            for out, size, offset in zip(self._outputs[i], self._sizes[i], self._offsets[i]):
                nbytes = size.numel() * out.element_size()
                out.view(torch.uint8).view(self.world, nbytes).copy_(table[:, offset:offset + nbytes])
            self._post_all_gather(i)

    def _post_all_gather(self, index: int) -> None:
        outputs = tuple(t.view(-1, *size[1:]) for t, size in zip(self._outputs[index], self._sizes[index]))
        metadata, self._metadata[index] = self._metadata[index], None
        owner = self._owners[index]
        if self.unsharded[index] is not None:
            owner.fsdp_post_all_gather(outputs, metadata, self.param_dtypes[index],
                                                  out=self.unsharded[index])
            return
        tensor, inner = owner.fsdp_post_all_gather(outputs, metadata, self.param_dtypes[index])
        shape = self.shapes[index]
        tensor = torch.as_strided(tensor, shape, contiguous_strides(tuple(shape)), 0)
        self.unsharded[index] = nn.Parameter(tensor, requires_grad=self.requires_grad[index])
        self._inner[index] = tuple(inner)
        self._inner_bytes[index] = [t.untyped_storage().nbytes() for t in inner]

    # ---- release ------------------------------------------------------------------------

    def free(self) -> None:
        """Release the gathered storage; the tensors (and what views them) stay."""
        for tensors in (*self._outputs, *self._inner):
            for t in tensors:
                _free(t)

    def gathered_tensors(self) -> list[torch.Tensor]:
        """The plain tensors whose storage comes and goes (for memory meters)."""
        return [t for tensors in (*self._outputs, *self._inner) for t in tensors]

    def gathered_bytes(self) -> int:
        """Bytes of the gathered outputs (allocated or not)."""
        return sum(sum(b) for b in self._output_bytes)
