"""flatfsdp: fully sharded data parallelism over flat, zero-copy buffers."""

from flatfsdp.engine import (CommAccount, FSDPModule, UnshardHandle, register_fsdp_forward_method, MixedPrecisionPolicy, ShardingStrategy,
                             allocated_buffer_bytes, comm_account, fully_shard, fully_shard_model,
                             fully_shard_optimizer, persistent_buffer_bytes, reset_parameters)
from flatfsdp.engine import (NonFiniteError, NonFiniteReport, ReplicaMismatch, check_finite, local_nonfinite,
                             nonfinite_report, verify_replicas)
from flatfsdp.engine import TIMEOUT_ENV, CollectiveTimeout

__all__ = [
    "CommAccount", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "MixedPrecisionPolicy", "ShardingStrategy", "comm_account", "fully_shard",
    "fully_shard_model", "fully_shard_optimizer", "persistent_buffer_bytes", "allocated_buffer_bytes", "reset_parameters",
    "NonFiniteError", "NonFiniteReport", "ReplicaMismatch", "check_finite", "local_nonfinite", "nonfinite_report",
    "verify_replicas", "CollectiveTimeout", "TIMEOUT_ENV",
]
