"""flatfsdp: fully sharded data parallelism over flat, zero-copy buffers."""

from flatfsdp.engine import (CommAccount, FSDPModule, MixedPrecisionPolicy, ShardingStrategy,
                             allocated_buffer_bytes, comm_account, fully_shard, fully_shard_model,
                             fully_shard_optimizer, mark_initialized, persistent_buffer_bytes,
                             reset_parameters)
from flatfsdp.pretrained import load_pretrained  # noqa: E402 (an application on the names above)

__all__ = [
    "CommAccount", "FSDPModule", "MixedPrecisionPolicy", "ShardingStrategy", "comm_account", "fully_shard",
    "fully_shard_model", "fully_shard_optimizer", "persistent_buffer_bytes", "allocated_buffer_bytes", "reset_parameters",
    "mark_initialized", "load_pretrained",
]
