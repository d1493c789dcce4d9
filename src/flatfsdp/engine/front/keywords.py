"""The one place where a call's keywords (front/keyword_table.GivenKeywords)
become ``ShardOptions``.

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

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from flatfsdp.engine.front.fsdp2_args import check_fsdp2_mesh, check_offload_policy, fsdp2_reshard_after_forward
from flatfsdp.engine.front.keyword_table import GivenKeywords
from flatfsdp.engine.front.spmd_mesh import spmd_dp_dims
from flatfsdp.engine.layout.arithmetic import check_block
from flatfsdp.engine.layout.mesh import check_device, check_hybrid_group, expert_dp_mesh, resolve_dp_mesh
from flatfsdp.engine.layout.main_home import HostHome
from flatfsdp.engine.layout.options import DEFAULT_BUCKET_BYTES, ShardOptions
from flatfsdp.engine.layout.precision import resolve_policy
from flatfsdp.engine.layout.strategy import ShardingStrategy
from flatfsdp.engine.layout.switches import EngineSwitches

_MAPPED = {"mesh", "strategy", "policy", "expert_mesh", "main_home", "reshard_after_forward", "average_grads",
           "sync_each_microbatch", "bucket_bytes", "shard_block", "ignored", "require_shardable", "replica_values",
           "switches", "on_nonfinite"}
"""Options fields built from other keywords below; every other field is a
keyword of the same name, copied as given (prefetch_bytes, meta_init_seed, ...)."""
_COPIED = tuple(sorted({f.name for f in dataclasses.fields(ShardOptions)} - _MAPPED))
"""(tests/test_megatron_api.py checks that each is a keyword of front/keyword_table.)"""


def shard_options(given: GivenKeywords, *, per_module: bool) -> ShardOptions:
    """The engine's reading of one call's keywords. ``per_module``: FSDP2's
    form (``fully_shard(module, mesh=...)``), which refuses what FSDP2
    refuses and warns where FSDP2 is silent."""
    _check_megatron_extras(given)
    if given.dp_mesh_dims is not None:
        given = _read_dp_mesh_dims(given, per_module)
    mesh, device_mesh = given.mesh, given.device_mesh
    if mesh is not None and device_mesh is not None and mesh is not device_mesh:
        raise ValueError("pass the mesh as either mesh= or device_mesh=, not two different meshes")
    check_fsdp2_mesh(mesh)
    mp_policy, megatron_policy = given.mp_policy, given.mixed_precision_policy
    if mp_policy is not None and megatron_policy is not None:
        raise ValueError("pass the policy as either mp_policy= or mixed_precision_policy=, not both")
    given_mesh = mesh if mesh is not None else device_mesh
    strategy = ShardingStrategy.parse(given.zero_dp_strategy)
    dp_mesh = resolve_dp_mesh(given_mesh, given.dp_shard_dim, given.dp_outer_dim)
    if _shards_across_outer(given.outer_dp_sharding_strategy, dp_mesh, strategy):
        dp_mesh = dp_mesh.with_split_replicas()
    check_hybrid_group(given.hybrid_fsdp_group, dp_mesh)
    _check_tp_dim(given.tp_dim, given_mesh)
    check_device(given.device, dp_mesh.shard)
    expert_mesh = None
    if given.expt_device_mesh is not None:
        expert_mesh = expert_dp_mesh(given.expt_device_mesh, given.dp_shard_dim, dp_mesh.size)
    wire = dict(param_gather_dtype=given.param_gather_dtype, grad_reduce_dtype=given.grad_reduce_dtype,
                lowbit_block=given.lowbit_block)
    policy = resolve_policy(mp_policy if mp_policy is not None else megatron_policy,
                            grad_reduce_in_fp32=given.grad_reduce_in_fp32,
                            preserve_fp32_weights=given.preserve_fp32_weights, wire=wire)
    check_offload_policy(given.offload_policy)
    check_block(given.shard_block)
    reshard = given.reshard_after_forward
    if per_module:
        reshard = fsdp2_reshard_after_forward(reshard, dp_mesh.shard)
    return ShardOptions(
        mesh=dp_mesh, strategy=strategy, policy=policy, expert_mesh=expert_mesh,
        main_home=HostHome.for_policy(given.offload_policy, dp_mesh.shard.device_type),
        reshard_after_forward=reshard,
        average_grads=not given.calculate_per_token_loss,
        sync_each_microbatch=given.sync_model_each_microbatch,
        bucket_bytes=_checked_bucket(given.bucket_bytes, given.disable_bucketing),
        shard_block=given.shard_block,
        ignored=frozenset(id(p) for p in given.ignored_params or ()),
        require_shardable=per_module,
        replica_values="warn" if per_module else "broadcast",
        switches=EngineSwitches.from_environment(),
        on_nonfinite="error" if given.report_nan_in_param_grad else None,
        **{name: getattr(given, name) for name in _COPIED})


def _check_megatron_extras(given: GivenKeywords) -> None:
    """Megatron-FSDP keywords that are no-ops here but whose values can still
    be wrong, and the one that cannot be honoured."""
    for name, group in (("fsdp_group_ag", given.fsdp_group_ag), ("expt_fsdp_group_ag", given.expt_fsdp_group_ag),
                        ("hybrid_fsdp_expt_group", given.hybrid_fsdp_expt_group)):
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"{name} must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
        if group is not None and name != "fsdp_group_ag" and given.expt_device_mesh is None:
            raise ValueError(f"{name} is a group of expert parameters: it needs expt_device_mesh=")
    if given.use_decoupled_grad:
        raise NotImplementedError(
            "use_decoupled_grad=True installs reduced gradients as param.decoupled_grad, which only "
            "TransformerEngine's FusedAdam (CUDA) reads; flatfsdp delivers them as param.grad, which every "
            "torch optimizer reads: leave use_decoupled_grad=False")


def spmd_mesh_of(given: GivenKeywords) -> DeviceMesh | None:
    """The mesh FSDP2's ``dp_mesh_dims`` is about: the whole SPMD mesh, given as mesh= (or device_mesh=)."""
    return given.mesh if given.mesh is not None else given.device_mesh


def _read_dp_mesh_dims(given: GivenKeywords, per_module: bool) -> GivenKeywords:
    """FSDP2's ``dp_mesh_dims`` over the whole SPMD mesh, read as this engine's
    (device_mesh, dp_shard_dim, dp_outer_dim, zero_dp_strategy). The door
    checks the parameters against that mesh (spmd_mesh.check_spmd_params)."""
    if not per_module:
        raise TypeError("dp_mesh_dims belongs to the per-module form fully_shard(module, mesh=..., "
                        "dp_mesh_dims=...); the one-call form takes dp_shard_dim= / dp_outer_dim=")
    if given.dp_shard_dim is not None or given.dp_outer_dim is not None:
        raise ValueError("pass the data-parallel dimensions either as dp_mesh_dims= or as "
                         "dp_shard_dim=/dp_outer_dim=, not both")
    reshard = given.reshard_after_forward
    if isinstance(reshard, int) and not isinstance(reshard, bool):
        raise NotImplementedError("reshard_after_forward as an int is not supported with dp_mesh_dims "
                                  "(as in FSDP2)")
    spmd = spmd_mesh_of(given)
    shard_name, replicate_name = spmd_dp_dims(spmd, given.dp_mesh_dims)
    if shard_name is None:  # replicate only: FSDP2's DDP
        return dataclasses.replace(given, mesh=None, device_mesh=spmd, dp_shard_dim=replicate_name,
                                   dp_outer_dim=None, zero_dp_strategy=ShardingStrategy.NO_SHARD)
    return dataclasses.replace(given, mesh=None, device_mesh=spmd, dp_shard_dim=shard_name,
                               dp_outer_dim=replicate_name)


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
