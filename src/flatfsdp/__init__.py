"""flatfsdp: fully sharded data parallelism over flat, zero-copy buffers.

The names below resolve on first use (PEP 562), not at ``import flatfsdp``:
the engine imports torch, which takes seconds, and the ``flatfsdp`` command's
parsers (flatfsdp.cli) live inside this package -- importing them must not pay
for torch, so ``flatfsdp --help`` and a mistyped flag answer at once. Code that
uses a name sees no difference: ``flatfsdp.fully_shard`` and ``from flatfsdp
import fully_shard`` import the engine then, once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the same names, for type checkers and readers (and the import contract's graph)
    from flatfsdp.engine import (CommAccount, FSDPModule, GradientReductionHandle, MixedPrecisionPolicy,
                                 ShardingStrategy, UnshardHandle, allocated_buffer_bytes, comm_account, fully_shard,
                                 fully_shard_model, fully_shard_optimizer, mark_initialized, persistent_buffer_bytes,
                                 persistent_bytes_by_role, resizable_buffers, held_tensors,
                                 register_fsdp_forward_method, reset_parameters)
    from flatfsdp.engine import (NonFiniteError, NonFiniteReport, ReplicaMismatch, check_finite, local_nonfinite,
                                 nonfinite_report, verify_replicas)
    from flatfsdp.engine import TIMEOUT_ENV, CollectiveTimeout
    from flatfsdp.engine import NONFINITE_ENV, NonFiniteWarning, set_on_nonfinite
    from flatfsdp.pretrained import load_pretrained

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


def __getattr__(name: str):
    if name == "load_pretrained":  # an application on the API, offered here because users look for it here
        from flatfsdp.pretrained import load_pretrained as value
    elif name in __all__:
        import flatfsdp.engine

        value = getattr(flatfsdp.engine, name)
    else:
        raise AttributeError(f"module 'flatfsdp' has no attribute {name!r}")
    globals()[name] = value  # what the import statement would have bound: later uses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
