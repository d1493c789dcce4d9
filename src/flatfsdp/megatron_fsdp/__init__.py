"""A package shaped like ``megatron_fsdp`` (0.6.1's public modules), answered by flatfsdp.

``import flatfsdp.megatron_fsdp as megatron_fsdp`` is a one-line switch for
code written against megatron_fsdp, and the package Megatron-Core's adapter
can be pointed at (docs/megatron.md: "Megatron-Core on flatfsdp"). It is an
application above flatfsdp's engine: it imports only ``flatfsdp.engine``'s
public names, reads its callers' config objects field by field
(config_fields.py) and never imports megatron_fsdp or megatron.core; the
engine never imports it.

Modules as in megatron_fsdp: ``megatron_fsdp`` (``MegatronFSDP``),
``fully_shard``, ``utils`` (``FSDPDistributedIndex`` of ``distributed_index``, ``find_megatron_fsdp``,
the tensor-parallel readers), ``mixed_precision``,
``distributed_data_parallel_config``, ``uneven_dtensor`` and
``param_and_grad_buffer.make_fsdp_dtensor`` (Megatron-LM's ``fsdp_dtensor``
checkpoints); and flatfsdp's own ``config_fields``, ``model_keys``,
``sharded_params`` (the parameters' two Megatron-FSDP
members) and the uneven-DTensor parts (``chunk_boxes``, ``chunk_exchange``,
``part_records``, ``uneven_chunks``, ``state_dict_chunks``).
"""

from flatfsdp.megatron_fsdp.distributed_data_parallel_config import DistributedDataParallelConfig
from flatfsdp.megatron_fsdp.fully_shard import fully_shard, fully_shard_model, fully_shard_optimizer
from flatfsdp.megatron_fsdp.megatron_fsdp import MegatronFSDP
from flatfsdp.megatron_fsdp.mixed_precision import MixedPrecisionPolicy
from flatfsdp.megatron_fsdp.utils import FSDPDistributedIndex

__version__ = "0.6.1"
"""The megatron_fsdp API this package answers (its public names and signatures), not flatfsdp's version."""

__all__ = ["DistributedDataParallelConfig", "MegatronFSDP", "FSDPDistributedIndex", "MixedPrecisionPolicy",
           "fully_shard", "fully_shard_model", "fully_shard_optimizer", "__version__"]
