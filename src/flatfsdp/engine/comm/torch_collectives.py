"""The flat-tensor collectives under the names this torch has.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single`` (same arguments, same
semantics) and deprecated the old names, which warn on every call. Older
torch (2.11, 2.12) has only the old names. Choosing once here keeps every
supported version warning-free and the rest of the engine on one spelling.
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``(output, input, group=None, async_op=False)``: equal shards, rank-major, into ``output``."""

reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``(output, input, op=SUM, group=None, async_op=False)``: this rank's equal slice of the sum."""
