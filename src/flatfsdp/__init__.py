"""flatfsdp: fully sharded data parallelism over flat, zero-copy buffers."""

from flatfsdp.engine import (CommAccount, FSDPModule, GradientReductionHandle, MixedPrecisionPolicy, ShardingStrategy,
                             UnshardHandle,
                             allocated_buffer_bytes, comm_account, fully_shard, fully_shard_model,
                             fully_shard_optimizer, mark_initialized, persistent_buffer_bytes,
                             persistent_bytes_by_role, resizable_buffers, held_tensors,
                             register_fsdp_forward_method, reset_parameters)
from flatfsdp.engine import (NonFiniteError, NonFiniteReport, ReplicaMismatch, check_finite, local_nonfinite,
                             nonfinite_report, verify_replicas)
from flatfsdp.engine import TIMEOUT_ENV, CollectiveTimeout
from flatfsdp.engine import NONFINITE_ENV, NonFiniteWarning, set_on_nonfinite
from flatfsdp.pretrained import load_pretrained  # noqa: E402 (an application on the names above)

__all__ = [
    "CommAccount", "FSDPModule", "GradientReductionHandle", "MixedPrecisionPolicy", "ShardingStrategy", "UnshardHandle",
    "comm_account",
    "fully_shard", "fully_shard_model", "fully_shard_optimizer", "persistent_buffer_bytes", "allocated_buffer_bytes",
    "persistent_bytes_by_role", "resizable_buffers", "held_tensors",
    "register_fsdp_forward_method", "reset_parameters",
    "NonFiniteError", "NonFiniteReport", "ReplicaMismatch", "check_finite", "local_nonfinite", "nonfinite_report",
    "verify_replicas", "CollectiveTimeout", "TIMEOUT_ENV",
    "mark_initialized", "load_pretrained",
    "set_on_nonfinite", "NonFiniteWarning", "NONFINITE_ENV",
]
