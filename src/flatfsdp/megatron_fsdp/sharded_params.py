"""Megatron-FSDP's members of a sharded parameter, on the parameters of a
``MegatronFSDP``.

Megatron-Core's ``fsdp_dtensor`` checkpoint code splits fused weights (SwiGLU's
``linear_fc1``, GDN's projections) with what it reads on the parameter --
``model.get_parameter(name)``, the DTensor the optimizer steps:

* ``megatron_fsdp_slice``: which run of the flattened parameter this rank's
  part holds (it cuts each half out of the part with it);
* ``megatron_fsdp_dist_index``: the index it hands back to
  ``param_and_grad_buffer.make_fsdp_dtensor`` and asks ``get_submesh([tp_dim])``
  and ``tp_dim``.

Megatron-Core and Megatron-Bridge also read, on the parameter its optimizer
steps, what they marked the parameter they made with (MEGATRON_MARKS: the
gradient norm's tensor-parallel and shared-copy filters,
``finalize_model_grads``' sequence-parallel all-reduce, ``decoupled_lr`` and
muP param groups) and ``orig_param``, that parameter itself (Bridge's weight
import reads its shape).

Stock sets all of them as attributes on each parameter. flatfsdp sets nothing
on torch's objects (docs/megatron.md): the parameter's class becomes its own
class with ``MegatronParamMembers`` in front (the engine's ``swap_class``, the
one place classes are swapped), whose members read the parameter itself --
the slice from its placements, as torch places its part (so it cannot go
stale), the index and the original parameter through the ``__fsdp_param__``
marker the one-call form already gives it, the marks from that original
(what the caller set, where the caller set it). A copy or pickle of the
parameter is a plain DTensor parameter, as before.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from flatfsdp.engine import swap_class
from flatfsdp.megatron_fsdp.chunk_boxes import Box, flat_range
from flatfsdp.megatron_fsdp.uneven_chunks import plain_copy


MEGATRON_MARKS = frozenset({"sequence_parallel", "shared", "tensor_model_parallel", "partition_dim",
                            "partition_stride", "is_embedding_or_output_parameter", "is_embedding_parameter",
                            "_tensor_parallel_mode"})
"""The marks stock carries from the parameter the caller made onto its DTensor (its ``reset_attribute`` list)."""


class MegatronParamMembers:
    """Put in front of a sharded parameter's class by ``give_megatron_members``."""

    def __getattr__(self, name: str) -> Any:
        """Only reached for what the parameter itself lacks: a mark, read from the original."""
        if name in MEGATRON_MARKS:
            original = getattr(vars(self).get("__fsdp_param__"), "original", None)
            if original is not None and name in vars(original):
                return vars(original)[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def orig_param(self) -> nn.Parameter:
        """The parameter the caller made, which this DTensor stands in for."""
        original = getattr(vars(self).get("__fsdp_param__"), "original", None)
        if original is None:
            raise RuntimeError("orig_param: the parameter this one was sharded from is gone")
        return original

    @property
    def megatron_fsdp_slice(self) -> slice:
        """This rank's part as one range of the flattened parameter."""
        shape, offsets = compute_local_shape_and_global_offset(self.shape, self.device_mesh, self.placements)
        found = flat_range(tuple(self.shape), Box(tuple(offsets), tuple(shape)))
        if found is None:
            raise ValueError(f"megatron_fsdp_slice: this parameter's part (shape {tuple(shape)} at {tuple(offsets)} "
                             f"of {tuple(self.shape)}, placements {self.placements}) is not one run of the "
                             "flattened parameter")
        return found

    @property
    def megatron_fsdp_dist_index(self) -> Any:
        """The sharded model's ``FSDPDistributedIndex`` (its ``get_distributed_index()``)."""
        view = getattr(vars(self).get("__fsdp_param__"), "view", None)
        if view is None:
            raise RuntimeError("megatron_fsdp_dist_index: the model this parameter was sharded in is gone")
        return view.get_distributed_index()

    def __deepcopy__(self, memo: dict) -> DTensor:
        return plain_copy(self, memo)

    def __reduce_ex__(self, protocol: int):
        return plain_copy(self, {}).__reduce_ex__(protocol)


def give_megatron_members(module: nn.Module) -> None:
    """Every sharded parameter of ``module`` (a DTensor carrying the one-call
    form's ``__fsdp_param__`` marker) answers Megatron-FSDP's members."""
    for param in module.parameters():
        if isinstance(param, DTensor) and vars(param).get("__fsdp_param__"):
            swap_class(param, MegatronParamMembers)
