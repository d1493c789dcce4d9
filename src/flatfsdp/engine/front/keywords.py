"""The one place where front-door keywords become ``ShardOptions``.

Megatron-FSDP's spellings (``device_mesh``, ``mixed_precision_policy``,
``calculate_per_token_loss``, ``sync_model_each_microbatch``, ...) and
FSDP2's (``mesh``, ``mp_policy``, ``offload_policy``, ``ignored_params``,
``dp_mesh_dims``, an int ``reshard_after_forward``) both map here, once, into
the engine's terms; nothing below the front doors sees a keyword. A keyword
spelled as an options field (``prefetch_bytes``, ``bucket_bytes``, ...) is
copied as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from flatfsdp.engine.front.fsdp2_args import check_fsdp2_mesh, check_offload_policy, fsdp2_reshard_after_forward
from flatfsdp.engine.front.spmd_mesh import check_spmd_params, spmd_dp_dims
from flatfsdp.engine.layout.arithmetic import check_block
from flatfsdp.engine.layout.mesh import check_device, check_hybrid_group, expert_dp_mesh, resolve_dp_mesh
from flatfsdp.engine.layout.main_home import HostHome
from flatfsdp.engine.layout.options import DEFAULT_BUCKET_BYTES, ShardOptions
from flatfsdp.engine.layout.precision import resolve_policy
from flatfsdp.engine.layout.strategy import ShardingStrategy
from flatfsdp.engine.layout.switches import EngineSwitches

ACCEPTED_NO_OPS: dict[str, str] = {
    "overlap_grad_reduce": "reductions always overlap the backward (a side stream, a bounded queue)",
    "overlap_param_gather": "gathers always overlap compute (prefetch of the next unit)",
    "preproc_state_dict_for_dcp_ckpt": "state dicts are always DCP-ready: every DTensor says what it holds",
    "average_in_collective": "reductions sum, then divide once by the data-parallel size: the average the "
                             "collective would take (gloo has no AVG), and the same for expert parameters",
    "keep_fp8_transpose_cache": "TransformerEngine FP8 weights only (CUDA)",
    "keep_fp8_transpose_cache_when_using_custom_fsdp": "Megatron-LM's name of keep_fp8_transpose_cache",
    "nccl_ub": "NCCL user-buffer registration (CUDA)",
    "fsdp_double_buffer": "a persistent NCCL double buffer (CUDA); flat buffers are allocated once anyway",
    "fsdp_db_use_persist_buf_on_alloc_fail": "a fallback of the NCCL double buffer's allocator (CUDA)",
    "disable_symmetric_registration": "NCCL window registration (CUDA)",
    "maxpool_double_buffer": "the NCCL double buffer's pool sizing (CUDA)",
    "enable_fine_grained_param_gather": "per-sub-module gathers for MXFP8 recompute (CUDA); a unit is "
                                        "gathered whole, values are the same",
    "cuda_graph_mode": "CUDA graph capture (CUDA); the .grad views stay the same tensors across steps "
                       "anyway, as graph replay needs",
    "fsdp_group_ag": "a second NCCL communicator for gathers beside reductions; gathers and reductions "
                     "already run on their own streams",
    "expt_fsdp_group_ag": "as fsdp_group_ag, for expert parameters",
    "hybrid_fsdp_expt_group": "the expert parameters' groups come from expt_device_mesh",
}
"""Megatron-FSDP keywords accepted for drop-in compatibility that change
nothing here, each with the reason (docs/megatron.md lists them too). Those
given as process groups are still checked to be process groups."""
MEGATRON_KEYWORDS = (
    "device_mesh", "dp_shard_dim", "dp_outer_dim", "tp_dim", "hybrid_fsdp_group", "hybrid_fsdp_expt_group",
    "expt_device_mesh", "fsdp_group_ag", "expt_fsdp_group_ag", "fsdp_unit_modules", "zero_dp_strategy",
    "outer_dp_sharding_strategy", "device", "init_model_with_meta_device", "mixed_precision_policy",
    "overlap_grad_reduce", "overlap_param_gather", "sync_model_each_microbatch", "preproc_state_dict_for_dcp_ckpt",
    "report_nan_in_param_grad", "average_in_collective", "disable_bucketing", "calculate_per_token_loss",
    "keep_fp8_transpose_cache", "nccl_ub", "fsdp_double_buffer", "fsdp_db_use_persist_buf_on_alloc_fail",
    "disable_symmetric_registration", "enable_fine_grained_param_gather", "use_decoupled_grad", "cuda_graph_mode",
    "maxpool_double_buffer")
"""megatron_fsdp.fully_shard_model's parameters after ``module`` (0.6.1 and
Megatron-LM main), in its positional order; ``fully_shard`` takes ``optimizer``
between. The front doors take them in this order too."""
MEGATRON_READ = {
    "device_mesh": "the mesh (with dp_shard_dim / dp_outer_dim / tp_dim: its dimensions)",
    "dp_shard_dim": "the dimension chunks are split over", "dp_outer_dim": "HSDP's replica dimension",
    "tp_dim": "checked to be a dimension of the mesh (DTensor parameters carry their own mesh)",
    "hybrid_fsdp_group": "checked against dp_outer x dp_shard", "expt_device_mesh": "expert parameters' mesh",
    "fsdp_unit_modules": "the units", "zero_dp_strategy": "ZeRO-0..3",
    "outer_dp_sharding_strategy": "HFSDP (optim) or HSDP (no_shard)",
    "device": "checked to agree with the mesh", "init_model_with_meta_device": "a confirmation: flatfsdp "
    "finds meta parameters itself and initialises them unit by unit (reset_parameters(), else "
    "_reset_parameters())",
    "mixed_precision_policy": "layout/precision.from_megatron_policy, field by field",
    "sync_model_each_microbatch": "reductions waited each backward, or left in flight for the step",
    "report_nan_in_param_grad": "NaN/inf gradients raise NonFiniteError (on_nonfinite='error')",
    "disable_bucketing": "no coalescing of small collectives (bucket_bytes=0)",
    "calculate_per_token_loss": "gradients summed, not averaged over data-parallel ranks",
    "use_decoupled_grad": "False; True is refused (only TransformerEngine's FusedAdam reads decoupled_grad)",
}
"""The Megatron keywords the engine reads, and how (the rest are ACCEPTED_NO_OPS)."""
_MAPPED = {"mesh", "strategy", "policy", "expert_mesh", "main_home", "reshard_after_forward", "average_grads",
           "sync_each_microbatch", "bucket_bytes", "shard_block", "ignored", "require_shardable", "replica_values",
           "switches", "on_nonfinite"}
"""Options fields built from other keywords below; every other field is a
keyword of the same name, copied as given (prefetch_bytes, meta_init_seed, ...)."""
_COPIED = {f.name for f in dataclasses.fields(ShardOptions)} - _MAPPED


def shard_options(module: Any, given: dict[str, Any], extra: dict[str, Any], *, per_module: bool) -> ShardOptions:
    """``given``: every named keyword of the front door, defaults included;
    ``extra``: what arrived through ``**kwargs``. ``per_module``: FSDP2's
    form (``fully_shard(module, mesh=...)``), which refuses what FSDP2
    refuses and warns where FSDP2 is silent."""
    unknown = set(extra) - set(ACCEPTED_NO_OPS)
    if unknown:
        raise TypeError(f"fully_shard got unexpected keyword argument(s) {sorted(unknown)}")
    g = {**extra, **given}
    _check_megatron_extras(g)
    if g.get("dp_mesh_dims") is not None:
        _read_dp_mesh_dims(module, g)
    mesh, device_mesh = g.get("mesh"), g.get("device_mesh")
    if mesh is not None and device_mesh is not None and mesh is not device_mesh:
        raise ValueError("pass the mesh as either mesh= or device_mesh=, not two different meshes")
    check_fsdp2_mesh(mesh)
    mp_policy, megatron_policy = g.get("mp_policy"), g.get("mixed_precision_policy")
    if mp_policy is not None and megatron_policy is not None:
        raise ValueError("pass the policy as either mp_policy= or mixed_precision_policy=, not both")
    given_mesh = mesh if mesh is not None else device_mesh
    strategy = ShardingStrategy.parse(g.get("zero_dp_strategy", 3))
    dp_mesh = resolve_dp_mesh(given_mesh, g.get("dp_shard_dim"), g.get("dp_outer_dim"))
    if _shards_across_outer(g.get("outer_dp_sharding_strategy", 0), dp_mesh, strategy):
        dp_mesh = dp_mesh.with_split_replicas()
    check_hybrid_group(g.get("hybrid_fsdp_group"), dp_mesh)
    _check_tp_dim(g.get("tp_dim"), given_mesh)
    check_device(g.get("device"), dp_mesh.shard)
    expert_mesh = None
    if g.get("expt_device_mesh") is not None:
        expert_mesh = expert_dp_mesh(g["expt_device_mesh"], g.get("dp_shard_dim"), dp_mesh.size)
    wire = {k: g.get(k) for k in ("param_gather_dtype", "grad_reduce_dtype", "lowbit_block")}
    policy = resolve_policy(mp_policy if mp_policy is not None else megatron_policy,
                            grad_reduce_in_fp32=g.get("grad_reduce_in_fp32", False),
                            preserve_fp32_weights=g.get("preserve_fp32_weights", True), wire=wire)
    check_offload_policy(g.get("offload_policy"))
    block = g.get("shard_block")
    check_block(block)
    reshard = g.get("reshard_after_forward")
    if per_module:
        reshard = fsdp2_reshard_after_forward(reshard, dp_mesh.shard)
    return ShardOptions(
        mesh=dp_mesh, strategy=strategy, policy=policy, expert_mesh=expert_mesh,
        main_home=HostHome.for_policy(g.get("offload_policy"), dp_mesh.shard.device_type),
        reshard_after_forward=reshard,
        average_grads=not g.get("calculate_per_token_loss", False),
        sync_each_microbatch=g.get("sync_model_each_microbatch", True),
        bucket_bytes=_checked_bucket(g.get("bucket_bytes"), g.get("disable_bucketing", False)),
        shard_block=block,
        ignored=frozenset(id(p) for p in g.get("ignored_params") or ()),
        require_shardable=per_module,
        replica_values="warn" if per_module else "broadcast",
        switches=EngineSwitches.from_environment(),
        on_nonfinite="error" if g.get("report_nan_in_param_grad") else None,
        **{name: g[name] for name in _COPIED if name in g})


def _check_megatron_extras(g: dict[str, Any]) -> None:
    """Megatron-FSDP keywords that are no-ops here (ACCEPTED_NO_OPS) but whose
    values can still be wrong, and the one that cannot be honoured."""
    for name in ("fsdp_group_ag", "expt_fsdp_group_ag", "hybrid_fsdp_expt_group"):
        group = g.get(name)
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"{name} must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    for name in ("expt_fsdp_group_ag", "hybrid_fsdp_expt_group"):
        if g.get(name) is not None and g.get("expt_device_mesh") is None:
            raise ValueError(f"{name} is a group of expert parameters: it needs expt_device_mesh=")
    if g.get("use_decoupled_grad"):
        raise NotImplementedError(
            "use_decoupled_grad=True installs reduced gradients as param.decoupled_grad, which only "
            "TransformerEngine's FusedAdam (CUDA) reads; flatfsdp delivers them as param.grad, which every "
            "torch optimizer reads: leave use_decoupled_grad=False")


def _read_dp_mesh_dims(module, g: dict[str, Any]) -> None:
    """FSDP2's ``dp_mesh_dims`` over the whole SPMD mesh, rewritten in place as
    this engine's (device_mesh, dp_shard_dim, dp_outer_dim, zero_dp_strategy)."""
    if g.get("fsdp_unit_modules") is not None or g.get("optimizer") is not None:
        raise TypeError("dp_mesh_dims belongs to the per-module form fully_shard(module, mesh=..., "
                        "dp_mesh_dims=...); the one-call form takes dp_shard_dim= / dp_outer_dim=")
    if g.get("dp_shard_dim") is not None or g.get("dp_outer_dim") is not None:
        raise ValueError("pass the data-parallel dimensions either as dp_mesh_dims= or as "
                         "dp_shard_dim=/dp_outer_dim=, not both")
    reshard = g.get("reshard_after_forward")
    if isinstance(reshard, int) and not isinstance(reshard, bool):
        raise NotImplementedError("reshard_after_forward as an int is not supported with dp_mesh_dims "
                                  "(as in FSDP2)")
    spmd = g["mesh"] if g.get("mesh") is not None else g.get("device_mesh")
    shard_name, replicate_name = spmd_dp_dims(spmd, g["dp_mesh_dims"])
    check_spmd_params(module, spmd)
    g.update(mesh=None, device_mesh=spmd)
    if shard_name is None:  # replicate only: FSDP2's DDP
        g.update(dp_shard_dim=replicate_name, dp_outer_dim=None, zero_dp_strategy=ShardingStrategy.NO_SHARD)
    else:
        g.update(dp_shard_dim=shard_name, dp_outer_dim=replicate_name)


def _checked_bucket(bucket_bytes: int | None, disable_bucketing: bool = False) -> int:
    """``disable_bucketing`` (Megatron-FSDP's): every collective on its own,
    unless ``bucket_bytes`` says otherwise."""
    if bucket_bytes is None:
        return 0 if disable_bucketing else DEFAULT_BUCKET_BYTES
    if not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be a non-negative number of bytes (0: never coalesce), got {bucket_bytes!r}")
    return bucket_bytes


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
    # One replica: nothing to split across, HFSDP is plain FSDP.
    return dp_mesh.outer.size() > 1


def _check_tp_dim(tp_dim: str | None, mesh) -> None:
    """``tp_dim`` names the tensor-parallel dimension; DTensor parameters
    carry their own mesh, so it is only checked to exist."""
    if tp_dim is None:
        return
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    if tp_dim not in names:
        raise ValueError(f"tp_dim={tp_dim!r} is not a dimension of the device mesh; its dimensions are {list(names)}")
