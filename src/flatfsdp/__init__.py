"""flatfsdp: fully sharded data parallelism over flat, zero-copy buffers."""

from flatfsdp.api import fully_shard, fully_shard_model
from flatfsdp.comm_account import CommAccount, comm_account
from flatfsdp.fsdp_module import FSDPModule
from flatfsdp.meta_init import reset_parameters
from flatfsdp.memory import allocated_buffer_bytes, persistent_buffer_bytes
from flatfsdp.optimizer import fully_shard_optimizer
from flatfsdp.precision import MixedPrecisionPolicy
from flatfsdp.strategy import ShardingStrategy

__all__ = [
    "CommAccount", "FSDPModule", "MixedPrecisionPolicy", "ShardingStrategy", "comm_account", "fully_shard",
    "fully_shard_model", "fully_shard_optimizer", "persistent_buffer_bytes", "allocated_buffer_bytes", "reset_parameters",
]
