"""State shared by every unit under one root module: the backward's start and
end, and the gradient reductions still in flight.

The root is the outermost sharded module whose forward runs first; it is found
lazily on that first forward, when the whole tree is known.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.autograd.profiler import record_function

from flatfsdp.engine.comm.coalesce import ReduceRequest
from flatfsdp.engine.comm.schedule_check import ScheduleCheck
from flatfsdp.engine.layout.device import SideStream
from flatfsdp.engine.layout.options import ShardOptions
from flatfsdp.engine.runtime.host_memory import release_free_host_memory
from flatfsdp.engine.runtime.nonfinite_flag import NonFiniteWatch, resolve_mode
from flatfsdp.engine.comm.reduction_queue import ReductionQueue
from flatfsdp.engine.runtime.training_state import TrainingState
from flatfsdp.engine.runtime.unit_controls import UnitControls


class ScheduledUnit(Protocol):
    """A unit as the root's schedule sees it. ``unit_state.UnitState`` is the
    one implementation; the protocol keeps this file below it (units hold
    their root context, so naming the class here would be an import circle)."""

    groups: list
    module: torch.nn.Module
    path: str
    controls: UnitControls
    training_state: TrainingState
    options: ShardOptions
    gathered_bytes: int
    forward_in_progress: bool
    initialized: bool

    def needs_post_backward(self) -> bool: ...
    def post_backward(self, *, defer_reduction: bool = False, release: bool = True) -> None: ...
    def reduce_accumulated(self) -> None: ...
    def finish_forward(self, context: "RootContext") -> None: ...
    def forget_forward(self) -> None: ...
    def reshard(self) -> None: ...


MAX_REDUCTIONS_IN_FLIGHT = 2
"""Each in-flight reduction holds an unsharded gradient buffer; two let one
reduce while the next unit's backward fills another, and bound the memory."""


class RootContext:
    def __init__(self, root: "ScheduledUnit", states: list["ScheduledUnit"]):
        self.root = root
        self.states = states
        self.in_backward = False
        self.training_forward = False
        self.root_forward_running = False
        options = root.options
        self.sync_each_microbatch = options.sync_each_microbatch
        self.prefetch_bytes = options.prefetch_bytes
        self.switches = options.switches
        """The FLATFSDP_* environment as the root's fully_shard read it (layout/switches.py)."""
        device = _device_of(states)
        self._on_host = device.type == "cpu"
        # Two streams so a gradient reduction never queues behind a prefetch.
        self.gather_stream = SideStream(device)
        in_flight = max([MAX_REDUCTIONS_IN_FLIGHT] + [s.controls.reduce_scatter_max_input_buffers for s in states])
        if all(g.buffers.layout.world == 1 for s in states for g in s.groups):
            # A first stage over one rank is a copy: kept in flight, it would only
            # hold its unsharded gradient buffer (a unit's, in the reduce dtype)
            # through the next units' backward. Each lands as it is issued.
            in_flight = 0
        self.reductions = ReductionQueue(bucket_bytes=options.bucket_bytes, max_in_flight=in_flight,
                                         stream=SideStream(device))
        # Units in the order their forwards ran: this step's (for backward
        # prefetch) and the last complete step's (for forward prefetch).
        self._order: list["ScheduledUnit"] = []
        self._last_order: list["ScheduledUnit"] = []
        self._paced: list = []
        """Paced transfers with slices still to post (``pace``)."""
        self.manual_finalization_active: bool | None = None
        """The root's ``manual_backward_finalization`` as it was when this
        backward began (fixed until the iteration is finalized); None between iterations."""
        self.reduction_pending = False
        """``finalize_backward(async_op=True)`` returned a handle not yet waited on."""
        self.nonfinite = NonFiniteWatch()  # Note [the non-finite flag]
        self._nonfinite_mode = resolve_mode(root.controls.on_nonfinite, self.switches.on_nonfinite)
        self.schedule = ScheduleCheck(self.switches.check_schedule)  # FLATFSDP_CHECK_SCHEDULE=1
        self._device = device
        self._schedule_checked = 0

    # ---- reductions in flight ----------------------------------------------------------

    def submit_reduction(self, request: ReduceRequest, group=None) -> None:
        # Every reduction of every unit, every step: nothing here may cost
        # more than a check while the debug checks are off.
        if self.schedule.enabled:
            self.schedule.record(f"the gradient reduction of unit '{getattr(request, 'unit', '?')}'")
        mode = self._nonfinite_mode
        if group is not None and mode != "off":
            delivered = group.grads_delivered
            # Summed once delivered (HFSDP's deferred outer step delivers later, unseen here).
            request.then.append(lambda: group.grads_delivered != delivered and self.nonfinite.note(group, mode))
        self.reductions.submit(request)

    def wait_reductions(self) -> None:
        self.reductions.wait_all()

    # ---- backward boundaries -----------------------------------------------------------

    def on_backward_start(self) -> None:
        if self.in_backward:
            return
        self.in_backward = True
        if self.manual_finalization_active is None:
            self.manual_finalization_active = self.root.controls.manual_backward_finalization
        # Runs once autograd has finished the whole backward, whichever units'
        # hooks did or did not fire.
        Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self, release: bool = True) -> None:
        """What ends a backward (autograd's callback runs it): units whose
        gradients wait in their parameters take them, reductions start (or
        wait for finalize_backward), units release their weights as
        ``reshard_after_backward`` says -- unless ``release`` is False: a
        caller driving the layers by hand keeps them (front/hand_driven.py)."""
        manual = bool(self.manual_finalization_active)
        with record_function("flatfsdp::finish_backward"):
            for state in reversed(self.states):
                if state.needs_post_backward():
                    # Manual finalization (FSDP2's): reductions of units whose
                    # hook did not fire wait for finalize_backward.
                    state.post_backward(defer_reduction=manual, release=release)
            if not manual and self.root.controls.is_last_backward and (
                    self.sync_each_microbatch or not self._bound_optimizers_wait()):
                self.wait_reductions()
            for state in self.states:
                if release and state.controls.reshard_after_backward:
                    state.reshard()
                state.training_state = TrainingState.IDLE
            self.in_backward = False
            self.nonfinite.backwards += 1
            if not manual:
                self.manual_finalization_active = None

    def finalize_backward(self) -> None:
        """The caller ends the backward iteration (FSDP2's manual finalization,
        and torch's pipeline stages): gradients accumulated but not yet
        reduced are reduced now where synchronisation is on, units release
        their weights as ``reshard_after_backward`` says. The reductions are
        in flight on return; ``end_backward_iteration`` waits for them."""
        with record_function("flatfsdp::finalize_backward"):
            for state in reversed(self.states):
                state.reduce_accumulated()
                if state.controls.reshard_after_backward:
                    state.reshard()
                state.training_state = TrainingState.IDLE

    def end_backward_iteration(self) -> None:
        """Wait for the iteration's reductions: every ``.grad`` is final."""
        self.wait_reductions()
        self.reduction_pending = False
        self.manual_finalization_active = None

    def _bound_optimizers_wait(self) -> bool:
        """Whether every gradient still in flight belongs to parameters that a
        bound optimizer steps: its step waits for them (see optimizer.py), so
        they may land while the host moves on. Otherwise an optimizer the engine
        does not know could step before they land: wait now."""
        return all(len(g.bound_optimizers) for s in self.states for g in s.groups if g.reduction_in_flight)

    def after_root_forward(self) -> None:
        """The root's forward returned: grouped units some of whose modules did
        not run finish now; without a backward to follow, release everything."""
        self.root_forward_running = False
        for state in self.states:
            if state.forward_in_progress:
                state.finish_forward(self)
        if not self.training_forward:
            self.reshard_all()  # no backward will: release prefetched units

    def reset_iter_state(self) -> None:
        """Forget a step cut short by an exception: release every unit and
        return to idle, so the next forward starts clean."""
        self.root_forward_running = self.in_backward = False
        self.manual_finalization_active = None
        self.reduction_pending = False
        self._paced = []  # each unit's release waits for (and so posts) what it left
        for state in self.states:
            state.forget_forward()
            state.reshard()
            state.training_state = TrainingState.IDLE

    def before_root_forward(self) -> None:
        """A new forward: reductions left running by an unsynced step land
        first, and the order recorded last time guides this step's prefetch."""
        if self.reduction_pending:
            raise RuntimeError("finalize_backward(async_op=True) returned a handle that was not waited on: call "
                               "its wait() before the next forward")
        self.wait_reductions()
        if self._order:
            self._last_order, self._order = self._order, []
        world = dist.group.WORLD if dist.is_initialized() else None
        if self.nonfinite.backwards != self._schedule_checked:  # a training step ended: compare schedules
            self._schedule_checked = self.nonfinite.backwards
            on_host = world is None or dist.get_backend(world) == "gloo"
            self.schedule.check(world, self.nonfinite.backwards, torch.device("cpu") if on_host else self._device)
        # Read once per step (the option or FLATFSDP_ON_NONFINITE), not per reduction.
        self._nonfinite_mode = resolve_mode(self.root.controls.on_nonfinite, self.switches.on_nonfinite)
        # Before release_consumed: a flagged group's main grads are still there to be named.
        self.nonfinite.check(self._nonfinite_mode, self._parameter_names,
                             dist.group.WORLD if dist.is_initialized() else None)
        for state in self.states:
            for group in state.groups:
                group.release_consumed_grads()
        # HFSDP: every unit's updated weights start across the outer (slow,
        # inter-node) dimension now, in unit order, and travel while the
        # forward computes; each unit's gather waits for its own. (Not before
        # a unit's first use: its deferred initialisation writes the weights then.)
        for state in self.states:
            if state.initialized:
                for group in state.groups:
                    group.refresh_early()
        if self._on_host:
            release_free_host_memory(self.switches.malloc_trim)

    def _parameter_names(self) -> dict:
        return {id(p): name for name, p in self.root.module.named_parameters()}

    # ---- execution order -----------------------------------------------------------------

    def record_forward(self, state: "ScheduledUnit") -> None:
        if state not in self._order:
            self._order.append(state)
            if self.schedule.enabled:
                self.schedule.record(f"the forward gather of unit '{state.path or '<root>'}'")

    def first_in_backward(self) -> bool:
        """No unit has finished its backward yet in this backward."""
        return not any(s.training_state == TrainingState.POST_BACKWARD for s in self.states)

    def last_in_forward(self, count: int) -> list["ScheduledUnit"]:
        """The last ``count`` units of this step's forward, the last first (the order backward needs them)."""
        return self._order[::-1][:count]

    def units_after_in_forward(self, state: "ScheduledUnit") -> int:
        """How many units ran their forward after ``state`` in the last complete step (0: unknown)."""
        order = self._last_order
        return len(order) - order.index(state) - 1 if state in order else 0

    def pace(self, transfers: list) -> None:
        """Transfers posted a slice at a time, at each unit's forward (comm/paced_gather.py)."""
        self._paced += transfers

    def pump_paced(self) -> None:
        if self._paced:
            for transfer in self._paced:
                transfer.pump()
            self._paced = [t for t in self._paced if not t.posted_all]

    def next_in_forward(self, state: "ScheduledUnit") -> list["ScheduledUnit"]:
        return _ahead(self._last_order, state, +1, self.prefetch_bytes)

    def is_last_in_forward(self, state: "ScheduledUnit") -> bool:
        return bool(self._last_order) and self._last_order[-1] is state

    def previous_in_forward(self, state: "ScheduledUnit") -> list["ScheduledUnit"]:
        return _ahead(self._order, state, -1, self.prefetch_bytes)

    def reshard_all(self) -> None:
        for state in self.states:
            state.reshard()


def _device_of(states: list["ScheduledUnit"]) -> torch.device:
    for state in states:
        for group in state.groups:
            return group.compute_device  # not main.device: main weights may live in host memory
    return torch.device("cpu")


def _ahead(order: list, state, step: int, limit_bytes: int | None) -> list:
    """The units after ``state`` in ``order`` (``step`` = +1 forward, -1
    backward) whose gathers fit in ``limit_bytes`` -- at least the next one;
    None: exactly the next one."""
    try:
        index = order.index(state) + step
    except ValueError:
        return []
    chosen, total = [], 0
    while 0 <= index < len(order):
        total += order[index].gathered_bytes
        if chosen and (limit_bytes is None or total > limit_bytes):
            break
        chosen.append(order[index])
        index += step
    return chosen
