"""megatron_fsdp's one-call functions, returning this package's ``MegatronFSDP``.

``fully_shard_model(module, ...)`` takes megatron_fsdp 0.6.1's keywords in its
order and returns a ``MegatronFSDP`` wrapping ``module`` (state-dict keys
``module.``-prefixed, as stock's); ``fully_shard_optimizer(optimizer)`` binds
an optimizer built on that model's parameters (or on the original ones, which
flatfsdp rebinds), and ``fully_shard(module, optimizer, ...)`` does both.
Unlike stock, the optimizer keeps the user's param groups and takes no eager
step; its state dict numbers parameters as torch's (and stock's) does, in the
optimizer's own order, so ``get_optimizer_state_dict`` names every entry
right and checkpoints move both ways where the optimizers list their
parameters alike; a state that does not fit is refused by name
(``flatfsdp.engine``'s load check). ``flatfsdp.fully_shard`` (unwrapped, unprefixed
keys) is unchanged: this is the door for code written against megatron_fsdp.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

import flatfsdp.engine as engine
from flatfsdp.megatron_fsdp.distributed_data_parallel_config import DistributedDataParallelConfig
from flatfsdp.megatron_fsdp.megatron_fsdp import MegatronFSDP
from flatfsdp.megatron_fsdp.distributed_index import FSDPDistributedIndex


def fully_shard_model(module: nn.Module, device_mesh=None, dp_shard_dim=None, dp_outer_dim=None, tp_dim=None,
                      hybrid_fsdp_group=None, hybrid_fsdp_expt_group=None, expt_device_mesh=None, fsdp_group_ag=None,
                      expt_fsdp_group_ag=None, fsdp_unit_modules=None, zero_dp_strategy: str | int = 3,
                      outer_dp_sharding_strategy: str | int = 0, device=None, init_model_with_meta_device=False,
                      mixed_precision_policy=None, overlap_grad_reduce=True, overlap_param_gather=True,
                      sync_model_each_microbatch=True, preproc_state_dict_for_dcp_ckpt=True,
                      report_nan_in_param_grad=False, average_in_collective=False, disable_bucketing=False,
                      calculate_per_token_loss=False, keep_fp8_transpose_cache=False, nccl_ub=False,
                      fsdp_double_buffer=False, fsdp_db_use_persist_buf_on_alloc_fail=False,
                      disable_symmetric_registration=False, enable_fine_grained_param_gather=False,
                      use_decoupled_grad=False, cuda_graph_mode=False, maxpool_double_buffer=False) -> MegatronFSDP:
    """Shard ``module`` and return the ``MegatronFSDP`` holding it."""
    inner = _strategy_name(zero_dp_strategy)
    outer = _strategy_name(outer_dp_sharding_strategy) if dp_outer_dim is not None else "no_shard"
    config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy=inner, outer_dp_sharding_strategy=outer,
        overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather,
        average_in_collective=average_in_collective, keep_fp8_transpose_cache=keep_fp8_transpose_cache, nccl_ub=nccl_ub, fsdp_double_buffer=fsdp_double_buffer,
        fsdp_db_use_persist_buf_on_alloc_fail=fsdp_db_use_persist_buf_on_alloc_fail,
        disable_symmetric_registration=disable_symmetric_registration,
        megatron_fsdp_use_decoupled_grad=use_decoupled_grad, megatron_fsdp_cuda_graph_mode=cuda_graph_mode,
        megatron_fsdp_enable_fine_grained_param_gather=enable_fine_grained_param_gather,
        megatron_fsdp_max_pool_double_buffer=maxpool_double_buffer)
    index = None
    if device_mesh is not None:
        index = FSDPDistributedIndex(device_mesh=device_mesh, dp_shard_dim=dp_shard_dim, dp_outer_dim=dp_outer_dim,
                                     tp_dim=tp_dim, hybrid_fsdp_group=hybrid_fsdp_group,
                                     hybrid_fsdp_expt_group=hybrid_fsdp_expt_group, hsdp_outer_dp_shard=outer != "no_shard",
                                     expt_device_mesh=expt_device_mesh, fsdp_group_ag=fsdp_group_ag,
                                     expt_fsdp_group_ag=expt_fsdp_group_ag)
    return MegatronFSDP(module, index, config, mixed_precision_policy, fsdp_unit_modules=fsdp_unit_modules,
                        disable_bucketing=disable_bucketing, device=device,
                        calculate_per_token_loss=calculate_per_token_loss,
                        init_model_with_meta_device=init_model_with_meta_device,
                        sync_model_each_microbatch=sync_model_each_microbatch,
                        report_nan_in_param_grad=report_nan_in_param_grad)


def fully_shard_optimizer(optimizer: torch.optim.Optimizer, preproc_state_dict_for_dcp_ckpt: bool = True, *,
                          model: MegatronFSDP | None = None) -> torch.optim.Optimizer:
    """Bind ``optimizer`` (stock's signature; ``model`` may be given, else it
    is found from the optimizer's parameters). Its ``step`` and ``zero_grad``
    take Megatron-FSDP's keywords."""
    if model is not None and not isinstance(model, MegatronFSDP):
        raise TypeError(f"model must be the MegatronFSDP fully_shard_model returned, got {type(model).__name__}")
    return engine.fully_shard_optimizer(optimizer, model=model.module if model is not None else None)


def fully_shard(module: nn.Module, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
    """``fully_shard_model`` then ``fully_shard_optimizer``: ``(model, optimizer)``;
    ``fully_shard_model``'s parameters follow ``optimizer``, in its order.
    The optimizer keeps its param groups (stock collapses them into one)."""
    given = _FULLY_SHARD.bind(module, optimizer, *args, **kwargs).arguments
    given.pop("optimizer")
    model = fully_shard_model(**given)
    return model, fully_shard_optimizer(optimizer, model=model)


_model_parameters = list(inspect.signature(fully_shard_model).parameters.values())
_FULLY_SHARD = inspect.Signature(_model_parameters[:1] + [inspect.Parameter(
    "optimizer", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=torch.optim.Optimizer)] + _model_parameters[1:])
fully_shard.__signature__ = _FULLY_SHARD


def _strategy_name(value: str | int) -> str:
    return engine.ShardingStrategy.parse(value).name.lower()
