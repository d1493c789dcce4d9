"""Megatron-FSDP's ``DistributedDataParallelConfig`` (0.6.1's fields and defaults).

A caller may pass this class or Megatron-Core's own config of the same name
(a superset): ``MegatronFSDP`` reads either by field through one table,
``config_fields.FIELDS``, and refuses a field the table does not name.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class DistributedDataParallelConfig:
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    check_for_nan_in_grad: bool = False
    bucket_size: int | None = None
    average_in_collective: bool = False
    fp8_param_gather: bool = False
    data_parallel_sharding_strategy: str = "no_shard"
    gradient_reduce_div_fusion: bool = True
    suggested_communication_unit_size: int | None = None
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    fsdp_all_gather_in_start_param_sync: bool = True
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False
    outer_dp_sharding_strategy: str = "no_shard"
    disable_symmetric_registration: bool = False
    fsdp_manual_registration: bool = False
    megatron_fsdp_main_params_dtype: torch.dtype | None = torch.float32
    megatron_fsdp_main_grads_dtype: torch.dtype | None = None
    megatron_fsdp_grad_comm_dtype: torch.dtype | None = None
    megatron_fsdp_use_decoupled_grad: bool = False
    megatron_fsdp_cuda_graph_mode: bool = False
    megatron_fsdp_enable_fine_grained_param_gather: bool = False
    megatron_fsdp_max_pool_double_buffer: bool = False
