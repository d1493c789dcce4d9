"""megatron_fsdp 0.6.1's ``param_and_grad_buffer.make_fsdp_dtensor``: the
DTensor of one rank's part of a (piece of a) sharded parameter.

Megatron-Core imports it (transformer/fsdp_dtensor_checkpoint.py: whether
that import works decides whether Megatron-Core sees Megatron-FSDP at all)
to split fused weights for ``fsdp_dtensor`` checkpoints: a SwiGLU
``linear_fc1`` into its two halves, a GDN projection into its parts. It cuts
this rank's part of the parameter with the parameter's ``megatron_fsdp_slice``
(sharded_params.py) and asks for a DTensor of the piece, over the index's
data-parallel mesh, placed as Megatron-FSDP places its parameters:

* ``Shard(0)`` over ``dp_shard_dim``;
* HSDP: ``(Replicate(), Shard(0))`` over ``(dp_outer_dim, dp_shard_dim)``;
* HFSDP: ``(Shard(0), Shard(0))`` over the same, the outer dimension innermost
  -- each shard chunk split across the replicas, as flatfsdp and stock lay it;
* not sharded: ``Replicate()`` on each.

A piece's parts are uneven (one rank may hold all of a half, the other none),
so the DTensor says its part (uneven_chunks), which takes a collective to
find. That collective is not run here, once per piece in the caller's key
order -- where ranks hold different optimizer entries that order differs and
stock hangs (NVIDIA/Megatron-LM#4910) -- but batched, by
``uneven_dtensor.preprocess_state_dict_for_uneven_dtensor``, which Megatron-LM
runs on the state dict next (or on first use, e.g. ``full_tensor()``).
``run_check`` and ``update_uneven_dtensor_chunk_meta`` are honoured there:
every piece's parts are checked to tile it, and then it says its part.

Megatron-Core's tensor parallelism is not flatfsdp's (the engine shards each
rank's local tensor over data parallelism only), so a tensor-parallel
parameter or mesh is refused by name rather than described wrongly.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from flatfsdp.megatron_fsdp.uneven_chunks import mark, over

__all__ = ["make_fsdp_dtensor"]


def make_fsdp_dtensor(local_tensor: torch.Tensor, param: torch.Tensor, dist_index: Any, is_sharded_param: bool = True,
                      is_expert_param: bool = False, run_check: bool = False,
                      update_uneven_dtensor_chunk_meta: bool = False,
                      force_sync_tp_duplicated_param: bool = False) -> DTensor:
    """``local_tensor`` (this rank's part of ``param``, flat or in rows of
    ``param``'s trailing shape) as a DTensor of ``param``'s shape over
    ``dist_index``'s data-parallel mesh, sharing its storage."""
    shape = tuple(param.shape)
    if not is_sharded_param and param.numel() != local_tensor.numel():
        raise ValueError(f"make_fsdp_dtensor: a parameter that is not sharded is whole on every rank, but its shape "
                         f"is {shape} and the local tensor's {tuple(local_tensor.shape)}")
    _refuse_tensor_parallelism(param, dist_index, is_expert_param)
    mesh, placements, nesting = _placement(dist_index, is_sharded_param, is_expert_param)
    if local_tensor.numel() % max(1, math.prod(shape[1:])):
        raise ValueError(f"make_fsdp_dtensor: a local part of {local_tensor.numel()} elements is not whole rows of "
                         f"a parameter of shape {shape}")
    try:  # a view, never a copy: what a checkpoint loads into the DTensor must land in the parameter
        local = local_tensor.view((-1, *shape[1:]))
    except RuntimeError as err:
        raise ValueError(f"make_fsdp_dtensor: the local part (shape {tuple(local_tensor.shape)}, strides "
                         f"{local_tensor.stride()}) cannot be viewed as rows of {shape} without a copy: {err}") from None
    out = over(local, mesh, placements, shape, _contiguous(shape))
    return mark(out, None, nesting) if is_sharded_param else out


def _placement(index: Any, sharded: bool, expert: bool):
    """The mesh, placements and nesting (innermost first; None: torch's) of the index's parameters."""
    if getattr(index, "use_hybrid_fsdp", False):
        mesh = index.get_submesh((index.dp_outer_dim, index.dp_shard_dim), is_expert_parallel=expert)
        if not sharded:
            return mesh, (Replicate(), Replicate()), None
        if getattr(index, "hsdp_outer_dp_shard", False):
            return mesh, (Shard(0), Shard(0)), (0, 1)
        return mesh, (Replicate(), Shard(0)), None
    mesh = index.get_submesh(index.dp_shard_dim, is_expert_parallel=expert)
    return mesh, ((Shard(0),) if sharded else (Replicate(),)), None


def _refuse_tensor_parallelism(param: torch.Tensor, index: Any, expert: bool) -> None:
    tp_dim = getattr(index, "tp_dim", None)
    tp = index.get_submesh(tp_dim, is_expert_parallel=expert).size() if tp_dim is not None else 1
    if tp > 1 or (isinstance(param, DTensor) and param._spec.num_shards > 1):
        raise NotImplementedError(
            f"make_fsdp_dtensor: a tensor-parallel parameter (tensor-parallel size {tp}, shape {tuple(param.shape)}): "
            "flatfsdp shards Megatron-Core models over data parallelism only, so its fsdp_dtensor checkpoints "
            "cannot describe tensor-parallel splits; train with --tensor-model-parallel-size 1")


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
