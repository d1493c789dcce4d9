"""The engine: sharding, communication and the runtime of sharded modules.

Imports nothing from the applications around it (``flatfsdp.train``,
``flatfsdp.bench``, ``flatfsdp.checkpoint``, the CLI); tests/test_architecture.py
enforces the layers drawn in docs/architecture.md.
"""

from flatfsdp.engine.layout.precision import MixedPrecisionPolicy
from flatfsdp.engine.layout.strategy import ShardingStrategy
from flatfsdp.engine.layout.device import copy_to_host
from flatfsdp.engine.comm.comm_account import CommAccount, comm_account
from flatfsdp.engine.comm import schedule_log
from flatfsdp.engine.comm.fingerprint import ReplicaMismatch, verify_replicas
from flatfsdp.engine.comm.watchdog import CollectiveTimeout
from flatfsdp.engine.layout.switches import TIMEOUT_ENV
from flatfsdp.engine.runtime.fsdp_module import (FSDPModule, GradientReductionHandle, UnshardHandle,
                                                register_fsdp_forward_method)
from flatfsdp.engine.runtime.meta_init import mark_initialized, reset_parameters
from flatfsdp.engine.front.api import fully_shard, fully_shard_model
from flatfsdp.engine.front.finite_check import (NonFiniteError, NonFiniteReport, check_finite, local_nonfinite,
                                                nonfinite_report)
from flatfsdp.engine.front.memory import (allocated_buffer_bytes, held_tensors, persistent_buffer_bytes,
                                          persistent_bytes_by_role, resizable_buffers)
from flatfsdp.engine.front.optimizer import fully_shard_optimizer
from flatfsdp.engine.front.megatron_model import hand_module_to_wrapper
from flatfsdp.engine.front.megatron_buffers import DistributedDataParallelConfig, DistributedIndexGroups
from flatfsdp.engine.front.keyword_table import MEGATRON as MEGATRON_KEYWORDS, MEGATRON_FSDP_CLASS, Door
from flatfsdp.engine.layout.mesh import sub_mesh
from flatfsdp.engine.runtime.class_swap import swap_class
from flatfsdp.engine.front.finite_check import set_on_nonfinite
from flatfsdp.engine.runtime.nonfinite_flag import MODE_ENV as NONFINITE_ENV, NonFiniteWarning

__all__ = [
    "CommAccount", "schedule_log", "FSDPModule", "GradientReductionHandle", "UnshardHandle", "register_fsdp_forward_method", "MixedPrecisionPolicy", "ShardingStrategy", "comm_account", "fully_shard",
    "fully_shard_model", "fully_shard_optimizer", "persistent_buffer_bytes", "allocated_buffer_bytes", "reset_parameters",
    "persistent_bytes_by_role", "resizable_buffers", "held_tensors",
    # reliability (docs/reliability.md)
    "NonFiniteError", "NonFiniteReport", "ReplicaMismatch", "check_finite", "local_nonfinite", "nonfinite_report",
    "verify_replicas", "CollectiveTimeout", "TIMEOUT_ENV",
    "mark_initialized",
    "set_on_nonfinite", "NonFiniteWarning", "NONFINITE_ENV",
    # for applications (checkpoint staging): where host copies of device tensors go
    "copy_to_host",
    # for flatfsdp.megatron_fsdp (the package shaped like megatron_fsdp): its MegatronFSDP wraps the model
    "hand_module_to_wrapper", "DistributedDataParallelConfig", "DistributedIndexGroups",
    "MEGATRON_KEYWORDS", "MEGATRON_FSDP_CLASS", "Door", "sub_mesh",
    # the one place an instance's class is swapped (flatfsdp.megatron_fsdp: uneven DTensors, sharded parameters)
    "swap_class",
]
