"""The two front doors. Both end in ``shard_unit``: the one-call form is a loop
over units, bottom-up, then the root."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from flatfsdp.engine.comm.fingerprint import take_first_replica, value_check_mode, warn_first_replica_taken
from flatfsdp.engine.front.keywords import shard_options
from flatfsdp.engine.front.megatron_model import adopt_megatron_members
from flatfsdp.engine.front.optimizer import fully_shard_optimizer
from flatfsdp.engine.front.shard_unit import is_expert, shard_unit
from flatfsdp.engine.front.unit_classes import resolve_unit_classes
from flatfsdp.engine.layout.mesh import mesh_device
from flatfsdp.engine.layout.options import ShardOptions
from flatfsdp.engine.layout.strategy import ShardingStrategy
from flatfsdp.engine.runtime.tied_params import params_used_outside


def fully_shard(module: nn.Module | list[nn.Module], optimizer: torch.optim.Optimizer | None = None,
                # Megatron-FSDP's parameters, in its positional order (keywords.MEGATRON_KEYWORDS):
                device_mesh: DeviceMesh | None = None, dp_shard_dim: str | None = None,
                dp_outer_dim: str | None = None, tp_dim: str | None = None, hybrid_fsdp_group: Any = None,
                hybrid_fsdp_expt_group: Any = None, expt_device_mesh: DeviceMesh | None = None,
                fsdp_group_ag: Any = None, expt_fsdp_group_ag: Any = None,
                fsdp_unit_modules: Iterable[type | str] | None = None,
                zero_dp_strategy: ShardingStrategy | int | str = 3, outer_dp_sharding_strategy: int | str = 0,
                device: Any = None, init_model_with_meta_device: bool = False, mixed_precision_policy: Any = None,
                overlap_grad_reduce: bool = True, overlap_param_gather: bool = True,
                sync_model_each_microbatch: bool = True, preproc_state_dict_for_dcp_ckpt: bool = True,
                report_nan_in_param_grad: bool = False, average_in_collective: bool = False,
                disable_bucketing: bool = False, calculate_per_token_loss: bool = False,
                keep_fp8_transpose_cache: bool = False, nccl_ub: bool = False, fsdp_double_buffer: bool = False,
                fsdp_db_use_persist_buf_on_alloc_fail: bool = False, disable_symmetric_registration: bool = False,
                enable_fine_grained_param_gather: bool = False, use_decoupled_grad: bool = False,
                cuda_graph_mode: bool = False, maxpool_double_buffer: bool = False, *,
                # FSDP2's (keyword-only there too):
                mesh: DeviceMesh | None = None, reshard_after_forward: bool | int | None = None,
                shard_placement_fn: Callable | None = None, offload_policy: Any = None,
                ignored_params: set[nn.Parameter] | None = None, mp_policy: Any = None, dp_mesh_dims: Any = None,
                # flatfsdp's own:
                grad_reduce_in_fp32: bool = False, preserve_fp32_weights: bool = True,
                prefetch_bytes: int | None = None, bucket_bytes: int | None = None,
                meta_init_seed: int | None = None, shard_block: int | tuple[int, int] | None = None,
                param_gather_dtype: Any = None, grad_reduce_dtype: Any = None,
                lowbit_block: int | None = None, **kwargs: Any):
    """Shard ``module``.

    * ``fully_shard(model, optimizer, fsdp_unit_modules=[Block], ...)`` shards every
      ``Block`` and then the root, binds ``optimizer``, returns ``(model, optimizer)``
      (Megatron-FSDP style; without an optimizer it returns the model). Every
      keyword of ``megatron_fsdp.fully_shard``, in its positional order; the
      model answers ``MegatronFSDP``'s members (docs/megatron.md).
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
    given = dict(locals())
    extra = given.pop("kwargs")
    per_module = fsdp_unit_modules is None and optimizer is None
    options = shard_options(module, given, extra, per_module=per_module)
    if per_module:
        shard_unit(module, options)
        return module
    if isinstance(module, (list, tuple)):
        raise TypeError("a list of modules is sharded as one unit by the per-module form, "
                        "fully_shard([m1, m2], mesh=...); the one-call form takes the model")
    if shard_placement_fn is not None:
        raise TypeError("shard_placement_fn belongs to the per-module form fully_shard(module, ...); "
                        "the one-call form takes shard_block=")
    _shard_model(module, fsdp_unit_modules or (), options, given)
    if optimizer is None:
        return module
    return module, fully_shard_optimizer(optimizer, model=module)


def fully_shard_model(module: nn.Module,
                      # Megatron-FSDP's parameters, in its positional order (keywords.MEGATRON_KEYWORDS):
                      device_mesh: DeviceMesh | None = None, dp_shard_dim: str | None = None,
                      dp_outer_dim: str | None = None, tp_dim: str | None = None, hybrid_fsdp_group: Any = None,
                      hybrid_fsdp_expt_group: Any = None, expt_device_mesh: DeviceMesh | None = None,
                      fsdp_group_ag: Any = None, expt_fsdp_group_ag: Any = None,
                      fsdp_unit_modules: Iterable[type | str] | None = None,
                      zero_dp_strategy: ShardingStrategy | int | str = 3, outer_dp_sharding_strategy: int | str = 0,
                      device: Any = None, init_model_with_meta_device: bool = False,
                      mixed_precision_policy: Any = None, overlap_grad_reduce: bool = True,
                      overlap_param_gather: bool = True, sync_model_each_microbatch: bool = True,
                      preproc_state_dict_for_dcp_ckpt: bool = True, report_nan_in_param_grad: bool = False,
                      average_in_collective: bool = False, disable_bucketing: bool = False,
                      calculate_per_token_loss: bool = False, keep_fp8_transpose_cache: bool = False,
                      nccl_ub: bool = False, fsdp_double_buffer: bool = False,
                      fsdp_db_use_persist_buf_on_alloc_fail: bool = False,
                      disable_symmetric_registration: bool = False, enable_fine_grained_param_gather: bool = False,
                      use_decoupled_grad: bool = False, cuda_graph_mode: bool = False,
                      maxpool_double_buffer: bool = False, *,
                      # flatfsdp's own:
                      grad_reduce_in_fp32: bool = False, preserve_fp32_weights: bool = True,
                      reshard_after_forward: bool | None = None, prefetch_bytes: int | None = None,
                      bucket_bytes: int | None = None, meta_init_seed: int | None = None,
                      shard_block: int | tuple[int, int] | None = None, param_gather_dtype: Any = None,
                      grad_reduce_dtype: Any = None, lowbit_block: int | None = None,
                      **kwargs: Any) -> nn.Module:
    """Megatron-FSDP's model half: shard units bottom-up, then the root. Bind an
    optimizer afterwards with ``fully_shard_optimizer``."""
    given = dict(locals())
    extra = given.pop("kwargs")
    _shard_model(module, fsdp_unit_modules or (), shard_options(module, given, extra, per_module=False), given)
    return module


def _shard_model(model: nn.Module, unit_entries: Iterable[type | str], options: ShardOptions,
                 given: dict[str, Any]) -> None:
    """The one-call form: units bottom-up, then the root, which also gets
    Megatron-FSDP's ``MegatronFSDP`` members (megatron_model.py)."""
    classes = resolve_unit_classes(unit_entries, model)
    options = _first_replica_wins(model, options)
    names = {id(m): n for n, m in model.named_modules()}
    units = [m for m in model.modules() if m is not model and classes and isinstance(m, classes)]
    # Children before parents, so each unit owns only what no inner unit took;
    # a parameter also used outside a unit (tied weights) is left to an outer one.
    for unit in reversed(units):
        shard_unit(unit, options, name=names[id(unit)], exclude=frozenset(params_used_outside(unit, model)))
    shard_unit(model, options, name="<root>")
    adopt_megatron_members(model, given, options, classes)


def _first_replica_wins(model: nn.Module, options: ShardOptions) -> ShardOptions:
    """The one-call form's answer to replicas built from different weights
    (an unseeded model on each rank): every rank takes the first rank's
    values, as DDP does, and one warning names the first parameter that
    differed. (Megatron-FSDP trains such replicas as a silent mix of shards;
    FLATFSDP_CHECK_REPLICAS=error refuses them.) Checked once for the whole
    model, so the units below need not check values again."""
    if value_check_mode(options.replica_values, options.switches.check_replicas) != "broadcast":
        return options
    mesh = options.mesh
    groups = [g.get_group() for g in (mesh.shard, mesh.outer) if g is not None and g.size() > 1]
    if not groups:
        return options
    values = [(name, p) for name, p in model.named_parameters()
              if id(p) not in options.ignored and (options.expert_mesh is None or not is_expert(p))]
    found = take_first_replica(type(model).__name__, values, groups, mesh_device(mesh.shard))
    if found:
        warn_first_replica_taken(found, stacklevel=4)
    return dataclasses.replace(options, replica_values="skip")
