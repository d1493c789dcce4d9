"""The helpers Megatron-Core imports from ``megatron_fsdp.utils``:
``FSDPDistributedIndex`` (distributed_index.py), ``find_megatron_fsdp`` and
the tensor-parallel attribute readers of its checkpoint code; and
``GlobalMemoryBuffer`` (memory_buffer.py), a public helper of that module.
"""

from __future__ import annotations

import torch
from torch import nn

from flatfsdp.megatron_fsdp.distributed_index import FSDPDistributedIndex
from flatfsdp.megatron_fsdp.megatron_fsdp import MegatronFSDP
from flatfsdp.megatron_fsdp.memory_buffer import GlobalMemoryBuffer

__all__ = ["FSDPDistributedIndex", "GlobalMemoryBuffer", "find_megatron_fsdp", "get_mcore_tensor_parallel_partition_dim",
           "is_mcore_tensor_model_parallel", "is_mcore_tensor_parallel_duplicated"]


def find_megatron_fsdp(model: nn.Module) -> nn.Module | None:
    """The ``MegatronFSDP`` in ``model``'s chain of ``.module`` wrappers, if any."""
    seen = set()
    while model is not None and id(model) not in seen:
        if isinstance(model, MegatronFSDP):
            return model
        seen.add(id(model))
        model = getattr(model, "module", None)
    return None


def get_mcore_tensor_parallel_partition_dim(param: torch.Tensor) -> int | None:
    """The dimension a Megatron-Core tensor-parallel parameter is split on
    (its ``_tensor_parallel_mode`` or ``partition_dim``), None if it is not split."""
    mode = getattr(param, "_tensor_parallel_mode", None)
    if mode in ("column", "row"):
        return 0 if mode == "column" else 1
    if getattr(param, "tensor_model_parallel", False):
        dim = getattr(param, "partition_dim", None)
        if dim is not None and dim >= 0:
            return int(dim)
    return None


def is_mcore_tensor_model_parallel(param: torch.Tensor) -> bool:
    return get_mcore_tensor_parallel_partition_dim(param) is not None


def is_mcore_tensor_parallel_duplicated(param: torch.Tensor) -> bool:
    return get_mcore_tensor_parallel_partition_dim(param) is None
