"""Megatron-FSDP's ``DistributedDataParallelConfig`` (0.6.1's fields and defaults).

The engine's own class, the one a one-call model's ``ddp_config`` is (front
/megatron_buffers.py), exported here under megatron_fsdp's module name. A
caller may pass it or Megatron-Core's own config of the same name (a
superset): ``MegatronFSDP`` reads either by field through one table,
``config_fields.FIELDS``, and refuses a field the table does not name.
"""

from flatfsdp.engine import DistributedDataParallelConfig

__all__ = ["DistributedDataParallelConfig"]
