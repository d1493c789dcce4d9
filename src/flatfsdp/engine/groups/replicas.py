"""The replica plan: how a group's data-parallel replicas relate, chosen once
per group (``replicas_for``) and carried as one object, as ``WireChoice`` is
for formats. Below it nothing asks whether there are replicas or how they
share the work.

====================  ===========================================================
plan                  what the replicas (ranks across the outer dimension) do
====================  ===========================================================
``NoReplicas``        nothing: there are none (or one)
``AllReduceReplicas`` HSDP: each holds the same chunks; reduced gradients are
                      all-reduced across them (chained after the inner
                      reduce-scatter, or once before the optimizer step)
``SplitReplicas``     HFSDP: each holds a piece of the chunks' main weights,
                      grads and optimizer state (comm/outer_shard.py); reduced
                      gradients are reduce-scattered across them, updated
                      weights all-gathered back
====================  ===========================================================

What a plan owns: the main weights' size and its view of them (``main_view``,
``own_chunk_of``), the gradients' follow-up reduction (``follow_up`` on the
request, ``land`` when it has landed, ``complete`` before a step), the
refresh of the gather source from the main weights, and the first replica's
broadcast. The gradient side calls back into a ``GradientSink``
(groups/gradients.py): sum a result into the main grads, hand them over.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.distributed as dist

from flatfsdp.engine.comm.coalesce import ReduceRequest
from flatfsdp.engine.comm.collectives import Pending
from flatfsdp.engine.comm.outer_shard import OuterShard
from flatfsdp.engine.layout import views
from flatfsdp.engine.layout.arithmetic import GroupLayout
from flatfsdp.engine.layout.main_home import MainHome
from flatfsdp.engine.layout.placement import GroupPlacement
from flatfsdp.engine.layout.switches import Transport


class GradientSink(Protocol):
    """What a plan hands landed gradients to (groups/gradients.GroupGradients)."""

    def has_data(self) -> bool: ...
    def sum_into_main(self, result: torch.Tensor, has_data: bool, divisor: float) -> None: ...
    def hand_over(self) -> None: ...
    def all_reduce_main_grads(self, group: dist.ProcessGroup) -> None: ...


class NoReplicas:
    """No replicas: the main weights are this rank's chunks, reductions end at the inner one."""

    splits_main = False
    """Whether the main weights are a piece of the chunks (never the chunks' own memory)."""
    lets_collective_average = True
    """Whether the inner reduction may average in the collective (nothing sums after it)."""

    def __init__(self, layout: GroupLayout, index: int):
        self.layout, self.index = layout, index

    # ---- the main weights ----------------------------------------------------------------

    @property
    def main_numel(self) -> int:
        return self.layout.shard_numel

    def main_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s part of a main-weights-shaped buffer (main weights or main grads)."""
        return views.local_chunk(flat, self.layout.params[index], self.index)

    def own_chunk_of(self, full: torch.Tensor, index: int) -> torch.Tensor:
        """This rank's part of a full-size value of parameter ``index``."""
        return views.chunk_of(full, self.layout.params[index], self.index)

    def gather_source(self, main: torch.Tensor, model_local: torch.Tensor) -> Pending | None:
        """Start filling the compute-dtype chunks ``model_local`` from the main
        weights with the replicas' help (None: the caller copies them itself)."""
        return None

    def code_gather(self, main: torch.Tensor) -> Callable | None:
        """How block-scaled codes of the chunks are gathered from the replicas' pieces (None: encoded here)."""
        return None

    def broadcast_main(self, tensors: list[torch.Tensor], home: MainHome, device: torch.device) -> None:
        """The first replica's main weights to every replica (where they hold the same)."""

    # ---- the gradients' follow-up ----------------------------------------------------------

    def follow_up(self, request: ReduceRequest, outer_now: bool) -> torch.Tensor | None:
        """Chain what follows the inner reduction onto ``request``; returns
        where a chained follow-up lands (None: in the request's output)."""
        return None

    def land(self, sink: GradientSink, result: torch.Tensor, landed: torch.Tensor | None, has_data: bool,
             divisor: float, outer_now: bool) -> None:
        """A reduction has landed in ``result`` (its follow-up in ``landed``): deliver what is due."""
        sink.sum_into_main(result, has_data, divisor)
        sink.hand_over()

    def complete(self, sink: GradientSink) -> None:
        """Before a step: whatever reduction across replicas is still owed."""

    def grads_dropped(self) -> None:
        """The optimizer dropped the main grads: nothing owed on them any more."""


class AllReduceReplicas(NoReplicas):
    """HSDP: every replica holds the same chunks; gradients all-reduced across them."""

    lets_collective_average = False

    def __init__(self, layout: GroupLayout, index: int, group: dist.ProcessGroup):
        super().__init__(layout, index)
        self.group = group
        self._due = False
        """The main grads hold sums over the shard mesh only: the all-reduce
        across replicas is still to come (reductions deferred to the step)."""

    def broadcast_main(self, tensors: list[torch.Tensor], home: MainHome, device: torch.device) -> None:
        for t in tensors:
            home.in_place_collective(t, device, lambda s: dist.broadcast(s, group=self.group, group_src=0))

    def follow_up(self, request: ReduceRequest, outer_now: bool) -> torch.Tensor | None:
        if outer_now and not self._due:
            # Only this backward's sums lack the replicas': the request
            # all-reduces just them (coalesced with the rest of its bucket),
            # chained after the reduce-scatter, never blocking (Pending.chain).
            request.outer = self.group
        return None

    def land(self, sink: GradientSink, result: torch.Tensor, landed: torch.Tensor | None, has_data: bool,
             divisor: float, outer_now: bool) -> None:
        sink.sum_into_main(result, has_data, divisor)
        if outer_now and self._due:
            # Earlier backwards' sums are in the main grads too: all-reduce the lot, once.
            sink.all_reduce_main_grads(self.group)
        self._due = not outer_now
        sink.hand_over()

    def complete(self, sink: GradientSink) -> None:
        if self._due:
            self._due = False
            sink.all_reduce_main_grads(self.group)

    def grads_dropped(self) -> None:
        self._due = False


class SplitReplicas(NoReplicas):
    """HFSDP: the main weights and grads are this rank's piece of its chunks."""

    splits_main = True
    lets_collective_average = False

    def __init__(self, layout: GroupLayout, index: int, split: OuterShard):
        super().__init__(layout, index)
        self.split = split
        self._partial: torch.Tensor | None = None
        """Reductions deferred: inner-reduced gradient chunks still to be
        reduce-scattered across the outer dimension."""
        self._divisor = 1.0

    @property
    def main_numel(self) -> int:
        return self.split.numel

    def main_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        return self.split.piece_view(flat, index)

    def own_chunk_of(self, full: torch.Tensor, index: int) -> torch.Tensor:
        return self.split.piece_of(full, index, self.index)

    def gather_source(self, main: torch.Tensor, model_local: torch.Tensor) -> Pending | None:
        return self.split.all_gather(main, model_local)

    def code_gather(self, main: torch.Tensor) -> Callable | None:
        split = self.split
        return lambda row, own: split.all_gather_codes(main, row, own)

    def follow_up(self, request: ReduceRequest, outer_now: bool) -> torch.Tensor | None:
        if not (outer_now and self._partial is None):
            return None
        # Nothing summed from earlier microbatches: the outer reduce-scatter
        # follows the inner one as a chained stage.
        piece = torch.empty(self.split.numel, dtype=request.output.dtype, device=request.output.device)
        inner_sums, split = request.output, self.split
        request.follow = lambda: split.reduce_scatter(inner_sums, piece)
        return piece

    def land(self, sink: GradientSink, result: torch.Tensor, landed: torch.Tensor | None, has_data: bool,
             divisor: float, outer_now: bool) -> None:
        if landed is not None:  # the outer reduce-scatter was chained: this rank's piece
            self._deliver(sink, landed, divisor)
            return
        # Sum inner-reduced chunks until the outer reduce-scatter is due.
        if self._partial is None:
            self._partial = result
        else:
            self._partial.add_(result)
        self._divisor = divisor
        if outer_now:
            self._deliver(sink, self._outer_reduce(), divisor)

    def complete(self, sink: GradientSink) -> None:
        if self._partial is not None:
            self._deliver(sink, self._outer_reduce(), self._divisor)

    @staticmethod
    def _deliver(sink: GradientSink, piece: torch.Tensor, divisor: float) -> None:
        sink.sum_into_main(piece, sink.has_data(), divisor)
        sink.hand_over()

    def _outer_reduce(self) -> torch.Tensor:
        """Reduce-scatter the summed chunks across the outer dimension;
        returns this rank's piece (not yet divided)."""
        partial, self._partial = self._partial, None
        piece = torch.empty(self.split.numel, dtype=partial.dtype, device=partial.device)
        self.split.reduce_scatter(partial, piece).wait()
        return piece


ReplicaPlan = NoReplicas | AllReduceReplicas | SplitReplicas


def replicas_for(layout: GroupLayout, placement: GroupPlacement, index: int, transport: Transport) -> ReplicaPlan:
    """The plan of a group placed as ``placement`` (``index``: its chunk on this rank)."""
    outer = placement.dp.outer
    if outer is None or outer.size() <= 1:
        return NoReplicas(layout, index)
    if placement.hybrid:
        return SplitReplicas(layout, index, OuterShard(layout, outer.get_group(), index, transport))
    return AllReduceReplicas(layout, index, outer.get_group())
