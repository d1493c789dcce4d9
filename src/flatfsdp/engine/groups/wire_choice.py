"""The point of choice: how one param group's bytes travel, decided once at
construction from the mixed-precision policy, like its placement. Below it
the group holds two codecs (comm/wire.py) and never asks which.

A new block-scaled format needs no change here: layout/block_formats.py's
registry makes it a value of ``param_gather_dtype`` / ``grad_reduce_dtype``,
and the block codecs carry any ``BlockFormat``.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatfsdp.engine.comm.block_gather import BlockScaledGather
from flatfsdp.engine.comm.block_reduce import BlockScaledReduce
from flatfsdp.engine.comm.cast_gather import CastGather
from flatfsdp.engine.comm.gather import GatherPlan
from flatfsdp.engine.comm.wire import GatherCodec, PlainReduce, ReduceCodec
from flatfsdp.engine.layout.block_formats import BlockFormat
from flatfsdp.engine.layout.main_home import MainHome
from flatfsdp.engine.layout.precision import MixedPrecisionPolicy
from flatfsdp.engine.layout.switches import Transport


@dataclass(frozen=True)
class WireChoice:
    transport: Transport
    weight_format: BlockFormat | None = None
    """Weights gathered as these block-scaled codes (None: in the compute dtype)."""
    grad_format: BlockFormat | None = None
    """Gradients reduce-scattered as these codes (None: in the reduction dtype)."""

    @staticmethod
    def for_group(policy: MixedPrecisionPolicy, transport: Transport, *, sharded: bool, floating: bool,
                  trainable: bool, home: MainHome, name: str) -> "WireChoice":
        """Codes travel only where something is sharded (a replicated group
        gathers nothing and all-reduces its gradients in fp32) and only for
        floating-point weights; gradient codes only for trainable groups."""
        weights = policy.gather_format if sharded and floating else None
        home.check_weight_codes(weights, name)
        grads = policy.reduce_format if sharded and trainable else None
        return WireChoice(transport, weights, grads)

    @property
    def gathers_codes(self) -> bool:
        """The gather encodes the main weights itself: the group keeps no
        compute-dtype shard, and gathered weights never alias main weights."""
        return self.weight_format is not None

    def gather_codec(self, buffers) -> GatherCodec | None:
        """The codec that gathers ``buffers``' weights (None: replicated, nothing travels)."""
        b, place = buffers, buffers.placement
        if not place.sharded:
            return None
        if self.weight_format is not None:
            return BlockScaledGather(b.layout, b.index, b.unsharded.data, self.weight_format,
                                     transport=self.transport, main_chunk=b.main_chunk,
                                     replica_gather=b.replicas.code_gather(b.main),
                                     keep_codes=not place.keep_model_weights)
        kept = place.keep_model_weights
        if not kept and b.holds_whole_group():  # nothing travels: no chunk was kept to send
            return CastGather(b.layout, b.unsharded.data, b.main_chunk, self.transport, in_place=b.gathered_is_main)
        return GatherPlan(b.layout, b.index, b.unsharded.data, b.unsharded.data if kept else b.model_local,
                          source_in_unsharded=kept, transport=self.transport, refresh=b.refresh_gather_source,
                          refresh_early=b.refresh_early)

    def reduce_codec(self) -> ReduceCodec:
        if self.grad_format is not None:
            return BlockScaledReduce(self.grad_format, self.transport)
        return PlainReduce(self.transport)
