"""The two front doors. Both end in ``shard_unit``: the one-call form is a loop
over units, bottom-up, then the root."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from flatfsdp.engine.front.fsdp2_args import check_fsdp2_mesh, check_offload_policy, fsdp2_reshard_after_forward
from flatfsdp.engine.layout.offload import HostOffload
from flatfsdp.engine.layout.arithmetic import check_block
from flatfsdp.engine.layout.mesh import check_device, check_hybrid_group, expert_dp_mesh, resolve_dp_mesh
from flatfsdp.engine.front.optimizer import fully_shard_optimizer
from flatfsdp.engine.layout.precision import resolve_policy
from flatfsdp.engine.front.shard_unit import shard_unit
from flatfsdp.engine.front.spmd_mesh import check_spmd_params, spmd_dp_dims
from flatfsdp.engine.layout.strategy import ShardingStrategy
from flatfsdp.engine.runtime.tied_params import params_used_outside
from flatfsdp.engine.front.unit_classes import resolve_unit_classes

# Megatron-FSDP keywords accepted for drop-in compatibility that change nothing
# here: overlap is always on, state dicts are always DCP-ready, and the NCCL
# buffer-registration knobs have no counterpart yet.
_ACCEPTED_NO_OPS = {"overlap_grad_reduce", "overlap_param_gather", "preproc_state_dict_for_dcp_ckpt",
                    "keep_fp8_transpose_cache_when_using_custom_fsdp", "nccl_ub", "fsdp_double_buffer",
                    "disable_symmetric_registration"}
_CHECKED = {"device"}  # accepted when it agrees with the mesh (see mesh.check_device)


def fully_shard(module: nn.Module | list[nn.Module], optimizer: torch.optim.Optimizer | None = None, *,
                mesh: DeviceMesh | None = None, device_mesh: DeviceMesh | None = None,
                dp_shard_dim: str | None = None, fsdp_unit_modules: Iterable[type | str] | None = None,
                zero_dp_strategy: ShardingStrategy | int | str = 3, reshard_after_forward: bool | int | None = None,
                shard_placement_fn: Callable | None = None, offload_policy: Any = None,
                ignored_params: set[nn.Parameter] | None = None,
                mp_policy: Any = None, mixed_precision_policy: Any = None, sync_model_each_microbatch: bool = True,
                calculate_per_token_loss: bool = False, grad_reduce_in_fp32: bool = False,
                preserve_fp32_weights: bool = True, init_model_with_meta_device: bool = False,
                prefetch_bytes: int | None = None, bucket_bytes: int | None = None,
                meta_init_seed: int | None = None, shard_block: int | tuple[int, int] | None = None,
                dp_outer_dim: str | None = None, tp_dim: str | None = None, hybrid_fsdp_group: Any = None,
                expt_device_mesh: DeviceMesh | None = None, outer_dp_sharding_strategy: int | str = 0,
                dp_mesh_dims: Any = None, param_gather_dtype: Any = None, grad_reduce_dtype: Any = None,
                lowbit_block: int | None = None, **kwargs: Any):
    """Shard ``module``.

    * ``fully_shard(model, optimizer, fsdp_unit_modules=[Block], ...)`` shards every
      ``Block`` and then the root, binds ``optimizer``, returns ``(model, optimizer)``
      (Megatron-FSDP style; without an optimizer it returns the model).
    * ``fully_shard(block, mesh=..., mp_policy=..., reshard_after_forward=...)`` shards
      one unit and returns it (PyTorch FSDP2 style; call bottom-up, then on the root).
      A list of modules becomes one unit (gathered and reduced together).
      ``shard_placement_fn``, ``offload_policy`` and ``ignored_params`` are
      FSDP2's (see docs/fsdp2.md); an int ``reshard_after_forward`` is read as
      FSDP2's: 1 keeps the weights gathered, any other size releases them.

    ``shard_block`` (B elements, or an (R, C) tile) keeps rank boundaries out of
    blocks, for block-wise optimizer state: see docs/placements.md.

    N-D meshes (docs/meshes.md): ``dp_outer_dim`` (or FSDP2's 2-D mesh) gives
    HSDP; ``dp_shard_dim`` may name a flattened ``(dp_shard, cp)`` dimension;
    parameters that are already DTensors (tensor parallelism, ``tp_dim``)
    are sharded over the data-parallel dimensions only; ``expt_device_mesh``
    shards expert parameters (``allreduce=False``) over its ``dp_shard_dim``.
    FSDP2's ``dp_mesh_dims`` (``mesh`` is the whole SPMD mesh) is read as
    those arguments: see spmd_mesh.

    Fewer bytes (docs/lowbit.md): ``param_gather_dtype="int8"`` or ``"fp8"``
    gathers weights as block-scaled 8-bit codes made once per optimizer step;
    ``grad_reduce_dtype="bf16"`` or ``"int8"`` reduces gradients so;
    at most ``lowbit_block`` elements share one scale.
    """
    if dp_mesh_dims is not None:
        if fsdp_unit_modules is not None or optimizer is not None:
            raise TypeError("dp_mesh_dims belongs to the per-module form fully_shard(module, mesh=..., "
                            "dp_mesh_dims=...); the one-call form takes dp_shard_dim= / dp_outer_dim=")
        mesh, device_mesh, dp_shard_dim, dp_outer_dim, zero_dp_strategy = _read_dp_mesh_dims(
            module, mesh if mesh is not None else device_mesh, dp_mesh_dims, dp_shard_dim, dp_outer_dim,
            reshard_after_forward, zero_dp_strategy)
    options = _options(mesh, device_mesh, dp_shard_dim, zero_dp_strategy, mp_policy, mixed_precision_policy,
                       grad_reduce_in_fp32, preserve_fp32_weights, calculate_per_token_loss,
                       sync_model_each_microbatch, init_model_with_meta_device, kwargs,
                       dict(dp_outer_dim=dp_outer_dim, tp_dim=tp_dim, hybrid_fsdp_group=hybrid_fsdp_group,
                            expt_device_mesh=expt_device_mesh, outer_dp_sharding_strategy=outer_dp_sharding_strategy),
                       dict(param_gather_dtype=param_gather_dtype, grad_reduce_dtype=grad_reduce_dtype,
                            lowbit_block=lowbit_block))
    options.update(prefetch_bytes=prefetch_bytes, bucket_bytes=bucket_bytes, meta_init_seed=meta_init_seed,
                   shard_block=_checked_block(shard_block))
    ignored = frozenset(id(p) for p in ignored_params or ())
    check_offload_policy(offload_policy)
    options["offload"] = HostOffload.for_mesh(offload_policy, options["mesh"].shard.device_type)
    if fsdp_unit_modules is None and optimizer is None:
        reshard = fsdp2_reshard_after_forward(reshard_after_forward, options["mesh"].shard)
        shard_unit(module, reshard_after_forward=reshard, shard_placement_fn=shard_placement_fn,
                   exclude=ignored, require_shardable=True, replica_values="warn", **options)
        return module
    if isinstance(module, (list, tuple)):
        raise TypeError("a list of modules is sharded as one unit by the per-module form, "
                        "fully_shard([m1, m2], mesh=...); the one-call form takes the model")
    if shard_placement_fn is not None:
        raise TypeError("shard_placement_fn belongs to the per-module form fully_shard(module, ...); "
                        "the one-call form takes shard_block=")
    _shard_model(module, fsdp_unit_modules or (), reshard_after_forward, options, ignored)
    if optimizer is None:
        return module
    return module, fully_shard_optimizer(optimizer, module)


def _read_dp_mesh_dims(module, spmd: DeviceMesh, dp_mesh_dims: Any, dp_shard_dim: str | None,
                       dp_outer_dim: str | None, reshard_after_forward, zero_dp_strategy):
    """FSDP2's ``dp_mesh_dims`` over the whole SPMD mesh, as this engine's
    (mesh, device_mesh, dp_shard_dim, dp_outer_dim, zero_dp_strategy)."""
    if dp_shard_dim is not None or dp_outer_dim is not None:
        raise ValueError("pass the data-parallel dimensions either as dp_mesh_dims= or as "
                         "dp_shard_dim=/dp_outer_dim=, not both")
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError("reshard_after_forward as an int is not supported with dp_mesh_dims "
                                  "(as in FSDP2)")
    shard_name, replicate_name = spmd_dp_dims(spmd, dp_mesh_dims)
    check_spmd_params(module, spmd)
    if shard_name is None:  # replicate only: FSDP2's DDP
        return None, spmd, replicate_name, None, ShardingStrategy.NO_SHARD
    return None, spmd, shard_name, replicate_name, zero_dp_strategy


def fully_shard_model(module: nn.Module, *, fsdp_unit_modules: Iterable[type | str] | None = None,
                      device_mesh: DeviceMesh | None = None, dp_shard_dim: str | None = None,
                      zero_dp_strategy: ShardingStrategy | int | str = 3, mixed_precision_policy: Any = None,
                      sync_model_each_microbatch: bool = True, calculate_per_token_loss: bool = False,
                      grad_reduce_in_fp32: bool = False, preserve_fp32_weights: bool = True,
                      init_model_with_meta_device: bool = False, reshard_after_forward: bool | None = None,
                      prefetch_bytes: int | None = None, bucket_bytes: int | None = None,
                      meta_init_seed: int | None = None, shard_block: int | tuple[int, int] | None = None,
                      dp_outer_dim: str | None = None, tp_dim: str | None = None, hybrid_fsdp_group: Any = None,
                      expt_device_mesh: DeviceMesh | None = None, outer_dp_sharding_strategy: int | str = 0,
                      param_gather_dtype: Any = None, grad_reduce_dtype: Any = None, lowbit_block: int | None = None,
                      **kwargs: Any) -> nn.Module:
    """Megatron-FSDP's model half: shard units bottom-up, then the root. Bind an
    optimizer afterwards with ``fully_shard_optimizer``."""
    options = _options(None, device_mesh, dp_shard_dim, zero_dp_strategy, None, mixed_precision_policy,
                       grad_reduce_in_fp32, preserve_fp32_weights, calculate_per_token_loss,
                       sync_model_each_microbatch, init_model_with_meta_device, kwargs,
                       dict(dp_outer_dim=dp_outer_dim, tp_dim=tp_dim, hybrid_fsdp_group=hybrid_fsdp_group,
                            expt_device_mesh=expt_device_mesh, outer_dp_sharding_strategy=outer_dp_sharding_strategy),
                       dict(param_gather_dtype=param_gather_dtype, grad_reduce_dtype=grad_reduce_dtype,
                            lowbit_block=lowbit_block))
    options.update(prefetch_bytes=prefetch_bytes, bucket_bytes=bucket_bytes, meta_init_seed=meta_init_seed,
                   shard_block=_checked_block(shard_block))
    _shard_model(module, fsdp_unit_modules or (), reshard_after_forward, options)
    return module


def _shard_model(model: nn.Module, unit_entries: Iterable[type | str], reshard_after_forward: bool,
                 options: dict, ignored: frozenset[int] = frozenset()) -> None:
    classes = resolve_unit_classes(unit_entries, model)
    names = {id(m): n for n, m in model.named_modules()}
    units = [m for m in model.modules() if m is not model and classes and isinstance(m, classes)]
    # Children before parents, so each unit owns only what no inner unit took;
    # a parameter also used outside a unit (tied weights) is left to an outer one.
    for unit in reversed(units):
        shard_unit(unit, reshard_after_forward=reshard_after_forward, name=names[id(unit)],
                   exclude=frozenset(params_used_outside(unit, model)) | ignored, **options)
    shard_unit(model, reshard_after_forward=reshard_after_forward, name="<root>", exclude=ignored, **options)


def _checked_block(block):
    check_block(block)
    return block


def _options(mesh, device_mesh, dp_shard_dim, zero_dp_strategy, mp_policy, mixed_precision_policy,
             grad_reduce_in_fp32, preserve_fp32_weights, calculate_per_token_loss, sync_model_each_microbatch,
             init_model_with_meta_device, extra: dict, nd: dict, lowbit: dict) -> dict:
    unknown = set(extra) - _ACCEPTED_NO_OPS - _CHECKED
    if unknown:
        raise TypeError(f"fully_shard got unexpected keyword argument(s) {sorted(unknown)}")
    if mesh is not None and device_mesh is not None and mesh is not device_mesh:
        raise ValueError("pass the mesh as either mesh= or device_mesh=, not two different meshes")
    check_fsdp2_mesh(mesh)
    if mp_policy is not None and mixed_precision_policy is not None:
        raise ValueError("pass the policy as either mp_policy= or mixed_precision_policy=, not both")
    given = mesh if mesh is not None else device_mesh
    strategy = ShardingStrategy.parse(zero_dp_strategy)
    dp_mesh = resolve_dp_mesh(given, dp_shard_dim, nd["dp_outer_dim"])
    if _shards_across_outer(nd["outer_dp_sharding_strategy"], dp_mesh, strategy):
        dp_mesh = dp_mesh.with_outer_sharding()
    check_hybrid_group(nd["hybrid_fsdp_group"], dp_mesh)
    _check_tp_dim(nd["tp_dim"], given)
    check_device(extra.get("device"), dp_mesh.shard)
    expert_mesh = None
    if nd["expt_device_mesh"] is not None:
        expert_mesh = expert_dp_mesh(nd["expt_device_mesh"], dp_shard_dim, dp_mesh.size)
    return dict(
        mesh=dp_mesh,
        expert_mesh=expert_mesh,
        strategy=strategy,
        policy=resolve_policy(mp_policy if mp_policy is not None else mixed_precision_policy,
                              grad_reduce_in_fp32=grad_reduce_in_fp32, preserve_fp32_weights=preserve_fp32_weights,
                              lowbit=lowbit),
        average_grads=not calculate_per_token_loss,
        sync_each_microbatch=sync_model_each_microbatch,
    )


def _shards_across_outer(value: int | str, dp_mesh, strategy: ShardingStrategy) -> bool:
    """Megatron-FSDP's ``outer_dp_sharding_strategy``: "no_shard" (0) keeps
    replicas across the outer dimension (HSDP); "optim" (1) shards the main
    weights and optimizer state across it too (HFSDP), over inner ZeRO-3."""
    outer = ShardingStrategy.parse(value)
    if outer == ShardingStrategy.NO_SHARD:
        return False
    if dp_mesh.outer is None:
        raise ValueError(f"outer_dp_sharding_strategy={value!r} needs an outer dimension (dp_outer_dim=)")
    if outer != ShardingStrategy.OPTIM:
        raise ValueError(f"outer_dp_sharding_strategy={value!r}: only no_shard (0) and optim (1) exist across "
                         "the outer dimension")
    if strategy != ShardingStrategy.OPTIM_GRADS_PARAMS:
        raise ValueError(f"outer_dp_sharding_strategy={value!r} (HFSDP) needs zero_dp_strategy=3 "
                         f"(optim_grads_params) inside each replica, got {strategy.name.lower()}")
    return True


def _check_tp_dim(tp_dim: str | None, mesh: DeviceMesh | None) -> None:
    """``tp_dim`` names the tensor-parallel dimension; DTensor parameters
    carry their own mesh, so it is only checked to exist."""
    if tp_dim is None:
        return
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    if tp_dim not in names:
        raise ValueError(f"tp_dim={tp_dim!r} is not a dimension of the device mesh; its dimensions are {list(names)}")
