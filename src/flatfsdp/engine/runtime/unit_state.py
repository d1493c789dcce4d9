"""The runtime of one sharded unit: its hooks and what they do to its param groups.

Forward:  pre-forward gathers (no-op if already gathered), post-forward
          releases unless the unit is kept gathered.
Backward: the first gradient reaching an output gathers again; when the
          gradient reaches the unit's inputs, its parameter gradients are all
          accumulated, so they are reduced and the weights released.
Activation recompute runs the forward again inside the backward: the context
knows a backward is running, so that forward neither gathers twice nor releases.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.autograd.profiler import record_function

from flatfsdp.engine.groups.group_core import ParamGroupFace
from flatfsdp.engine.layout.options import ShardOptions
from flatfsdp.engine.layout.precision import MixedPrecisionPolicy
from flatfsdp.engine.runtime.deferred_init import DeferredInit
from flatfsdp.engine.runtime.gather_units import gather_units
from flatfsdp.engine.runtime.root_context import RootContext
from flatfsdp.engine.runtime.structures import tensors_in
from flatfsdp.engine.runtime.unit_controls import HEAD_START_UNITS, UnitControls, needing_weights_in_backward, \
    rows_all_local
from flatfsdp.engine.runtime.unit_hooks import PostBackward, cast_floating
from flatfsdp.engine.runtime.training_state import TrainingState


class UnitState:
    """One unit: a module, or several modules sharded together by one call
    (``fully_shard([norm, head])``): one set of param groups, gathered when the
    first of them runs and released when the last of them is done."""

    def __init__(self, modules: list[nn.Module], groups: list[ParamGroupFace], options: ShardOptions,
                 deferred: DeferredInit | None = None):
        self._modules = [weakref.ref(m) for m in modules]
        self.groups = groups
        self.options = options
        """How the unit was sharded (fixed); what may change at run time is in ``controls``."""
        self.requires_grad_sync = True
        self.controls = UnitControls(reshard_after_forward=options.reshard_after_forward,
                                     on_nonfinite=options.on_nonfinite)
        self.training_state = TrainingState.IDLE
        self.context: RootContext | None = None
        self.deferred = deferred if deferred is not None else DeferredInit(pending=[], meta_originals={}, seed=0,
                                                                           conflicts=[])
        """What is owed between sharding and the first use (deferred_init)."""
        self.paths = [""] * len(modules)
        """Each module's name in the model the outermost fully_shard call sharded."""
        self._swapped_in = False
        self._rows_only = False
        """Gathered are only the rows a lookup needed (set_lookup_rows_only), not the whole table."""
        self._gathers: list = []
        self._forwarded: set[int] = set()
        """Modules of a grouped unit whose forward ran in the current root forward."""
        # Under torch.compile(model) the hooks run eagerly, at graph breaks:
        # they move storage, wait on collectives and walk Python state (the
        # stale-optimizer check), none of which a graph can hold; the module's
        # own computation between them is still compiled.
        for module in modules:
            module.register_forward_pre_hook(torch.compiler.disable(self.pre_forward), prepend=True,
                                             with_kwargs=True)
            module.register_forward_hook(torch.compiler.disable(self.post_forward), with_kwargs=True)

    @property
    def policy(self) -> MixedPrecisionPolicy:
        return self.options.policy

    @property
    def modules(self) -> list[nn.Module]:
        modules = [ref() for ref in self._modules]
        assert all(m is not None for m in modules), "a sharded module was garbage collected"
        return modules

    @property
    def module(self) -> nn.Module:
        """The unit's (first) module."""
        return self.modules[0]

    @property
    def path(self) -> str:
        """The unit's name in the model ("a, b" for modules sharded together)."""
        return ", ".join(self.paths)

    def index_of(self, module: nn.Module) -> int:
        return next(i for i, ref in enumerate(self._modules) if ref() is module)

    @property
    def is_root(self) -> bool:
        return self.context is not None and self.context.root is self

    # ---- gather / release ---------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> None:
        """Gather every group (no-op if gathered or on the way); the module
        computes with the gathered views once ``wait_unshard`` returns."""
        gather_units([self], async_op)

    def ensure_initialized(self) -> None:
        """At the unit's first use: take parameters the user replaced since
        sharding (see replaced_params), then run a meta-device unit's deferred
        initialisation (see meta_init) for the parameters still awaiting it."""
        self.adopt_replaced_params()
        if self.deferred.pending:
            from flatfsdp.engine.runtime.meta_init import initialize_pending
            initialize_pending(self)

    def adopt_replaced_params(self) -> None:
        """Once, at the unit's first use: take the parameters the user replaced since sharding."""
        if not self.deferred.first_use_seen:
            from flatfsdp.engine.runtime.replaced_params import adopt_replaced_params
            self.deferred.user_valued |= adopt_replaced_params(self)
            self.deferred.first_use_seen = True

    @property
    def initialized(self) -> bool:
        """Its first use is behind it: parameters adopted, deferred initialisation run."""
        return self.deferred.first_use_seen and not self.deferred.pending

    @property
    def is_gathered(self) -> bool:
        """The module holds the gathered parameters (or they are on their way)."""
        return self._swapped_in

    def await_gathers(self, pendings: list) -> None:
        """These gathers bring this unit's weights: the gathered views go in
        now, ``wait_unshard`` waits for them."""
        self._gathers = pendings
        for group in self.groups:
            group.use_unsharded_params()
        self._swapped_in = True

    def wait_unshard(self) -> None:
        gathers, self._gathers = self._gathers, []
        if gathers:
            with record_function(self.label("wait_unshard")):
                for pending in gathers:
                    pending.wait()

    def reshard(self, keep_codes: bool = False) -> None:
        if not self._swapped_in:
            return
        with record_function(self.label("reshard")):
            self.wait_unshard()
            for group in self.groups:
                group.reshard(free_storage=not self.controls.keep_unsharded_storage, keep_codes=keep_codes)
                group.use_sharded_params()
            self._swapped_in = self._rows_only = False

    def _unshard_now(self) -> None:
        self.unshard(async_op=False)
        self.wait_unshard()

    def _gather_rows(self, args: tuple, kwargs: dict) -> None:
        """An embedding's forward: only the rows of the ids it is given (and
        the other ranks are given) travel (set_lookup_rows_only)."""
        ids = args[0] if args else kwargs["input"]
        with record_function(self.label("lookup_rows")):
            gathered = self._swapped_in  # whole, already (a user's unshard): the groups only note the rows
            if gathered:
                self.wait_unshard()
            else:
                self.ensure_initialized()
            for group in self.groups:
                group.gather_rows(ids)
            if not gathered:
                self.await_gathers([])
                self._rows_only = True

    def _gather_whole(self, async_op: bool) -> None:
        """The rows a lookup left give way to the whole table (a tied head
        reads it); started after the lookup, paced (comm/paced_gather.py)."""
        split = self._rows_only
        if split:
            self.wait_unshard()
            for group in self.groups:
                group.forget_rows()
            self._swapped_in = self._rows_only = False
        if split and async_op:
            slices = max(1, self.context.units_after_in_forward(self))
            paced = [group.gather_paced(slices, f"unit '{self.path}': forward gather (paced)") for group in self.groups]
            self.await_gathers(paced)
            self.context.pace(paced)
        else:
            self.unshard(async_op)
        if split and torch.is_grad_enabled():  # that module's gradient reaches the engine on its own
            for group in self.groups:
                group.install_faces()

    def _looks_up_rows(self, module: nn.Module, context: RootContext) -> bool:  # needing only its ids' rows
        return self.controls.lookup_rows_only and not context.in_backward and isinstance(module, nn.Embedding)

    def _prefetch(self, states: list["UnitState"]) -> None:
        """Start gathering these units' weights so they arrive while this unit
        computes (one coalesced launch for all of them)."""
        with record_function(self.label("prefetch")):
            gather_units(states, async_op=True)

    @property
    def gathered_bytes(self) -> int:
        return sum(g.memory().gathered_bytes for g in self.groups)

    # ---- forward hooks ------------------------------------------------------------------

    def label(self, phase: str) -> str:
        """Profiler label of one phase of this unit (listed in docs/overlap.md)."""
        return f"flatfsdp::{phase} ({self.path or '<root>'})"

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        context = self.lazy_init()
        with record_function(self.label("pre_forward")):
            # (A grouped root begins its forward once, with its first module.)
            starts = len(self._modules) == 1 or not context.root_forward_running
            if self.is_root and not context.in_backward and starts:
                context.before_root_forward()
                # A training step, even where a reentrant recompute region runs
                # its first forward under no_grad inside it.
                context.training_forward = torch.is_grad_enabled()
                context.root_forward_running = True
            if not context.in_backward:
                self.training_state = TrainingState.FORWARD
                context.record_forward(self)
                self._forwarded.add(id(module))
            if self._looks_up_rows(module, context):
                self._gather_rows(args, kwargs)
            else:
                self._gather_whole(async_op=False)
                self.wait_unshard()
            if not context.in_backward:
                explicit = self.controls.forward_prefetch
                self._prefetch([s for s in context.next_in_forward(self) if not s.controls.lookup_rows_only]
                               if explicit is None else explicit)
                context.pump_paced()  # after this unit's prefetch: a slice of a paced gather
            if torch.is_grad_enabled() and any(g.trainable for g in self.groups):
                args, kwargs = PostBackward.register(self, args, kwargs)
            if self.policy.cast_forward_inputs and self.policy.param_dtype is not None:
                args, kwargs = cast_floating((args, kwargs), self.policy.param_dtype)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        context = self.context
        grad = torch.is_grad_enabled()
        with record_function(self.label("post_forward")):
            if not context.in_backward:
                if not self._others_still_to_run(context):
                    self.finish_forward(context)
                elif self._rows_only and context.training_forward:
                    # Another module needs the whole table (a tied head runs
                    # last): it travels while the modules between compute.
                    self._gather_whole(async_op=True)
                if self.is_root:
                    context.after_root_forward()
            if grad and not self._looks_up_rows(module, context):  # a lookup's backward needs no weights
                for tensor in tensors_in(output):
                    if tensor.requires_grad:
                        tensor.register_hook(self._pre_backward)
            if self.policy.output_dtype is not None:
                output = cast_floating(output, self.policy.output_dtype)
        return output

    def _others_still_to_run(self, context: RootContext) -> bool:
        """A grouped unit inside the root's forward stays gathered until each of
        its modules has run (or the root's forward ends: see finish_forward)."""
        if len(self._modules) == 1 or self.is_root or not context.root_forward_running:
            return False
        return len(self._forwarded) < len(self._modules)

    @property
    def forward_in_progress(self) -> bool:
        """Some of a grouped unit's modules ran their forward, the unit has not finished it."""
        return bool(self._forwarded)

    def modules_yet_to_forward(self) -> set[nn.Module]:
        """A grouped unit's modules that have not run forward yet in this root
        forward; empty for a single-module unit or outside a forward (as FSDP2)."""
        modules = self.modules
        if len(modules) == 1 or not self._forwarded:
            return set()
        return {m for m in modules if id(m) not in self._forwarded}

    def forget_forward(self) -> None:
        self._forwarded.clear()

    def finish_forward(self, context: RootContext) -> None:
        """The unit's forward is over: release its weights unless kept."""
        self._forwarded.clear()
        if not (context.training_forward and self._keep_gathered_after_forward(context)):
            self.reshard(keep_codes=context.training_forward)
        self.training_state = TrainingState.IDLE

    def _keep_gathered_after_forward(self, context: RootContext) -> bool:
        """The root stays gathered (needed throughout); unless told otherwise, so does the
        unit last in forward (its backward, first, would gather it again) -- unless that
        gather is a cast (a whole-group chunk): kept, it only swells the loss's peak."""
        if self._rows_only:  # only some rows are there: never kept for others to read
            return False
        reshard = self.controls.reshard_after_forward
        if reshard is False:
            return True
        if self.is_root:
            return reshard is not True
        return reshard is None and context.is_last_in_forward(self) and not rows_all_local(self)

    # ---- backward -----------------------------------------------------------------------

    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        self.context.on_backward_start()
        if self.training_state != TrainingState.PRE_BACKWARD or not self._swapped_in:
            with record_function(self.label("pre_backward")):
                self.training_state = TrainingState.PRE_BACKWARD
                if self.controls.unshard_in_backward:
                    self._unshard_now()
                explicit = self.controls.backward_prefetch
                self._prefetch(needing_weights_in_backward(self.context.previous_in_forward(self))
                               if explicit is None else explicit)
        return grad

    def needs_post_backward(self) -> bool:
        return self._swapped_in or any(p.grad is not None for g in self.groups for p in g.grad_leaves())

    def post_backward(self, *, defer_reduction: bool = False, release: bool = True) -> None:
        """Autograd's gradients into the accumulation buffer; reduced now if
        gradient sync is on (and the reduction not deferred to ``finalize_backward``);
        the weights released if ``reshard_after_backward`` (and ``release``) says so."""
        with record_function(self.label("post_backward")):
            head_first = self.controls.lookup_rows_only and self.context.first_in_backward()
            self.training_state = TrainingState.POST_BACKWARD
            for group in self.groups:
                group.accumulate_grads(self.controls.reduce_scatter_unused_params)
            if head_first:
                # A tied head's whole gradient, first thing in backward: its
                # reduction would sit on the link in front of the gathers the
                # next units' backward needs. They go first.
                self._prefetch(needing_weights_in_backward(self.context.last_in_forward(HEAD_START_UNITS)))
            if not defer_reduction:
                self.reduce_accumulated()
            if release and self.controls.reshard_after_backward:
                self.reshard()

    def reduce_accumulated(self) -> None:
        """Hand the gradients accumulated so far to reduction, if gradient sync is on."""
        if not self.requires_grad_sync:
            return
        controls = self.controls
        for group in self.groups:
            request = group.reduction_request(self.options.average_grads,
                                                        controls.gradient_divide_factor, controls.all_reduce_hook,
                                                        all_reduce=controls.requires_all_reduce,
                                                        defer_to_step=not self.options.sync_each_microbatch,
                                                        sum_only=controls.force_sum_reduction)
            if request is not None:
                request.unit = self.path or "<root>"
                self.context.submit_reduction(request, group)

    # ---- root discovery -----------------------------------------------------------------

    def lazy_init(self) -> RootContext:
        if self.context is not None:
            return self.context
        from flatfsdp.engine.runtime.tied_params import check_params_stay_in_units

        from flatfsdp.engine.runtime.stale_optimizers import check_no_stale_optimizer

        states = unit_states(*self.modules)
        for state in states:
            if state.deferred.errors:
                raise state.deferred.errors[0]
        for state in states:
            state.adopt_replaced_params()
        for module in self.modules:
            check_params_stay_in_units(module)
        check_no_stale_optimizer(states)
        for state in states:
            if state is not self and state.controls.manual_backward_finalization:
                raise RuntimeError(f"set_manual_backward_finalization must be called on the root sharded module; "
                                   f"unit '{state.path}' is not the root ('{self.path or '<root>'}' is)")
        context = RootContext(self, states)
        for state in states:
            state.context = context
        return context


def unit_states(*modules: nn.Module) -> list[UnitState]:
    """The runtime of every sharded unit in these modules' trees (themselves
    included), each once (a grouped unit is reached through each of its modules)."""
    found: dict[int, UnitState] = {}
    for module in modules:
        for m in module.modules():
            # Set by fsdp_module.become_fsdp_module on every sharded module (and
            # only there); read from the instance dict, so a plain module costs
            # no attribute-lookup miss.
            state = m.__dict__.get("_flatfsdp_state")
            if state is not None:
                found.setdefault(id(state), state)
    return list(found.values())
