"""Megatron-FSDP's ``MixedPrecisionPolicy``: the three dtypes a caller names.

flatfsdp's engine reads this object field by field (``main_params_dtype``,
``main_grads_dtype``, ``grad_comm_dtype``), as it reads the stock class; this
one exists so that code importing it from ``megatron_fsdp`` (Megatron-Core's
adapter builds one from its ``DistributedDataParallelConfig``) finds it here.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    main_params_dtype: torch.dtype | None = torch.float32
    """The sharded main weights' dtype (what the optimizer steps); None: the model's own."""
    main_grads_dtype: torch.dtype | None = None
    """The sharded main gradients' dtype; None: the parameters' dtype."""
    grad_comm_dtype: torch.dtype | None = None
    """The dtype gradients are reduced in; None: ``main_grads_dtype``."""
