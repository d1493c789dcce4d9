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


_MODULE = inspect.Parameter("module", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="nn.Module")
_MODEL_DOOR = engine.Door("fully_shard_model", (_MODULE,), engine.MEGATRON_KEYWORDS, (), aliases=False)
"""megatron_fsdp's signature, from the engine's keyword table (as flatfsdp.fully_shard_model's)."""


@_MODEL_DOOR.takes
def fully_shard_model(module: nn.Module, *args: Any, **kwargs: Any) -> MegatronFSDP:
    """Shard ``module`` and return the ``MegatronFSDP`` holding it."""
    given = _MODEL_DOOR.record(args, kwargs)
    inner = _strategy_name(given.zero_dp_strategy)
    outer = _strategy_name(given.outer_dp_sharding_strategy) if given.dp_outer_dim is not None else "no_shard"
    as_given = {k.ddp_field: getattr(given, k.name) for k in engine.MEGATRON_KEYWORDS if k.ddp_field is not None}
    config = DistributedDataParallelConfig(data_parallel_sharding_strategy=inner, outer_dp_sharding_strategy=outer,
                                           **as_given)
    index = None
    if given.device_mesh is not None:
        index = FSDPDistributedIndex(
            device_mesh=given.device_mesh, dp_shard_dim=given.dp_shard_dim, dp_outer_dim=given.dp_outer_dim,
            tp_dim=given.tp_dim, hybrid_fsdp_group=given.hybrid_fsdp_group,
            hybrid_fsdp_expt_group=given.hybrid_fsdp_expt_group, hsdp_outer_dp_shard=outer != "no_shard",
            expt_device_mesh=given.expt_device_mesh, fsdp_group_ag=given.fsdp_group_ag,
            expt_fsdp_group_ag=given.expt_fsdp_group_ag)
    return MegatronFSDP(module, index, config, given.mixed_precision_policy, fsdp_unit_modules=given.fsdp_unit_modules,
                        disable_bucketing=given.disable_bucketing, device=given.device,
                        calculate_per_token_loss=given.calculate_per_token_loss,
                        init_model_with_meta_device=given.init_model_with_meta_device,
                        sync_model_each_microbatch=given.sync_model_each_microbatch,
                        report_nan_in_param_grad=given.report_nan_in_param_grad)


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
