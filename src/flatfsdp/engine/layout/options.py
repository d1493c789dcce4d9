"""Every choice a front door's keywords make about sharding, as one frozen record.

Both front doors (Megatron-FSDP's one call and FSDP2's per-module call) turn
their keywords into a ``ShardOptions`` at the edge (front/keywords.py, the
one place where each spelling is mapped); ``shard_unit`` and a unit's
runtime read it and nothing else. Adding a keyword means a field here, the
keyword in the front door's signature, and the code that reads the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from flatfsdp.engine.layout.mesh import DataParallelMesh
from flatfsdp.engine.layout.main_home import DEVICE, MainHome
from flatfsdp.engine.layout.precision import MixedPrecisionPolicy
from flatfsdp.engine.layout.strategy import ShardingStrategy
from flatfsdp.engine.layout.switches import EngineSwitches

DEFAULT_BUCKET_BYTES = 4 << 20
"""Collectives on buffers under 4 MiB are coalesced: on gloo here a 4 MiB
gather costs ~5 ms against ~0.7 ms of fixed latency, and copying it ~0.4 ms."""


@dataclass(frozen=True)
class ShardOptions:
    mesh: DataParallelMesh
    """The data-parallel meshes a unit is sharded and reduced over."""
    strategy: ShardingStrategy = ShardingStrategy.OPTIM_GRADS_PARAMS
    """ZeRO-0..3 (``zero_dp_strategy``), resolved into placements per group."""
    policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    """Compute, main, reduction and wire dtypes (``mp_policy`` / ``mixed_precision_policy``)."""
    expert_mesh: DataParallelMesh | None = None
    """Where expert parameters (``allreduce=False``) are sharded (``expt_device_mesh``)."""
    main_home: MainHome = DEVICE
    """Where main weights and grads live: the device, or host memory (FSDP2's policy, layout/main_home.py)."""
    reshard_after_forward: bool | None = None
    """Release a unit's weights after its forward (None: all but the root and
    the unit that runs last)."""
    average_grads: bool = True
    """Divide summed gradients by the data-parallel size (``calculate_per_token_loss=False``)."""
    sync_each_microbatch: bool = True
    """Reduce after every backward (``sync_model_each_microbatch``); False
    defers the replicas' all-reduce to the optimizer step."""
    prefetch_bytes: int | None = None
    """Prefetch as many next units as fit in this many gathered bytes (None: one)."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Collectives on smaller buffers are coalesced (0: never)."""
    meta_init_seed: int | None = None
    """Seed of deferred meta-device initialisation (None: rank 0's ``torch.initial_seed()``)."""
    shard_block: int | tuple[int, int] | None = None
    """Keep rank boundaries out of blocks of this many elements or (rows, cols) tiles."""
    shard_placement_fn: Callable | None = None
    """FSDP2's per-parameter ``Shard(dim)`` choice."""
    ignored: frozenset[int] = frozenset()
    """ids of parameters left alone (FSDP2's ``ignored_params``)."""
    require_shardable: bool = False
    """Refuse scalar and non-contiguous parameters as FSDP2 does (else they are replicated)."""
    replica_values: str = "broadcast"
    """What replicas that start from different weights do: "broadcast" (take
    the first rank's, as DDP does, and say so once: the one-call form),
    "warn" (keep them, as FSDP2 does: the per-module form), "error" or "skip"
    (FLATFSDP_CHECK_REPLICAS in ``switches`` overrides)."""
    on_nonfinite: str | None = None
    """NaN/inf gradients: "error" (Megatron-FSDP's ``report_nan_in_param_grad``),
    or None (the root's default: FLATFSDP_ON_NONFINITE, else "warn")."""
    switches: EngineSwitches = field(default_factory=EngineSwitches)
    """The FLATFSDP_* environment, read once at the front door."""
