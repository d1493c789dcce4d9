"""``GroupTensors``: what a param group holds on this rank, as one frozen
record of flat tensors -- the face front doors read (Megatron-FSDP's
``param_and_grad_buffer`` views, front/megatron_buffers.py) instead of a
group's buffers. Both kinds of group make one (``ParamGroupFace.tensors``).

A flat group's record holds the engine's own tensors: what is written there
the engine reads. A group of tensor-subclass parameters holds its weights as
instances of the subclass, one per parameter, never one flat tensor; its
record's weights are flat copies of their plain values, made when asked
(``engine_storage`` False), its main grads the engine's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from flatfsdp.engine.layout import views
from flatfsdp.engine.layout.arithmetic import GroupLayout


@dataclass(frozen=True)
class GroupTensors:
    model_weights: torch.Tensor
    """What the module computes with, flat: the kept unsharded weights, or
    this rank's compute-dtype chunks (``model_weights_sharded``)."""
    model_weights_sharded: bool
    main_weights: torch.Tensor
    """What the optimizer steps, flat (this rank's chunks where ``sharded``)."""
    main_in_model_weights: bool
    """The main weights are the kept model weights themselves (one dtype, ZeRO-0/1/2)."""
    main_grads: torch.Tensor | None
    """The reduced gradients the optimizer reads, laid out as the main
    weights (None: a frozen group; released between steps under ZeRO-2/3)."""
    sharded: bool
    """Main weights and grads hold this rank's chunks only (else every parameter whole)."""
    process_group: dist.ProcessGroup
    """The ranks the chunks are split (or replicas reduced) over."""
    rank_index: int
    """Which chunk this rank holds (0 when replicated)."""
    world: int
    compute_dtype: torch.dtype
    main_dtype: torch.dtype
    engine_storage: bool
    """The weights are the engine's own tensors (False: copies, see the module docstring)."""
    layout: GroupLayout
    main_view: Callable[[torch.Tensor, int], torch.Tensor]
    """Parameter i's part of a main-weights-shaped flat tensor (the group's replica plan's view)."""

    def model_item(self, index: int, only_shard: bool = False) -> torch.Tensor:
        """Parameter ``index`` in the model weights, flat: whole where they are
        kept whole (unless ``only_shard``), else this rank's chunk."""
        p = self.layout.params[index]
        if self.model_weights_sharded:
            return views.local_chunk(self.model_weights, p, self.rank_index).reshape(-1)
        if only_shard:
            return views.unsharded_chunk(self.model_weights, p, self.rank_index).reshape(-1)
        return views.unsharded_param(self.model_weights, p).reshape(-1)

    def main_item(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s part of the main weights, flat."""
        if self.main_in_model_weights:
            return views.unsharded_chunk(self.main_weights, self.layout.params[index], self.rank_index).reshape(-1)
        return self.main_view(self.main_weights, index).reshape(-1)

    def grad_item(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s part of the main grads, flat."""
        return self.main_view(self.main_grads, index).reshape(-1)


def plain_values(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor subclass's values as a plain tensor: the one inner tensor a
    wrapper holds at its own shape (torchao's float8 training weight: its
    high-precision values), else what it dequantizes to (NF4)."""
    if not hasattr(tensor, "__tensor_flatten__"):
        return tensor
    names, _ = tensor.__tensor_flatten__()
    if len(names) == 1:
        inner = getattr(tensor, names[0])
        if inner.shape == tensor.shape:
            return plain_values(inner)
    for method in ("get_original_weight", "dequantize"):
        if callable(getattr(tensor, method, None)):
            return plain_values(getattr(tensor, method)())
    raise TypeError(f"a {type(tensor).__name__} parameter has no plain values to show: it wraps "
                    f"{len(names)} tensors and has neither get_original_weight() nor dequantize()")
