"""The members Megatron-LM's training loop, its optimizer and megatron_fsdp's
README call on the model ``fully_shard`` returns (a ``MegatronFSDP`` there).

flatfsdp's one-call form shards the user's module in place and returns it,
as it always has; these members are added to the root's class *behind*
everything the module already has. ``MegatronMembers.__getattr__`` answers a
Megatron name only where the module's class, its attributes, parameters,
buffers and sub-modules have nothing of that name: a model with its own
``device``, ``module`` or ``sync`` keeps it. The members themselves live on a
``MegatronView`` held by the root (runtime state belongs to the sharded
module); each acts on flatfsdp's own units and buffers (docs/megatron.md).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Iterator

from torch import nn

from flatfsdp.engine.front import hand_driven
from flatfsdp.engine.front.keyword_table import GivenKeywords
from flatfsdp.engine.front.megatron_buffers import DistributedDataParallelConfig, DistributedIndex, ParamAndGradBufferView
from flatfsdp.engine.front.shard_unit import is_expert
from flatfsdp.engine.layout.mesh import mesh_device
from flatfsdp.engine.layout.options import ShardOptions
from flatfsdp.engine.runtime.class_swap import swap_class
from flatfsdp.engine.runtime.unit_state import unit_states

MEMBERS = frozenset({
    "module", "ddp_config", "dist_index", "get_distributed_index", "mp_policy", "device", "fsdp_unit_modules",
    "data_parallel_sharding_strategy", "param_and_grad_buffer", "model_auto_sync", "set_model_auto_sync", "sync",
    "microbatch_count", "mixed_precision_context", "reset_mixed_precision_policy", "zero_grad_buffer",
    "start_param_sync", "start_grad_sync", "finish_grad_sync", "synchronize_param_gather",
    "synchronize_gradient_reduce", "attach_grad_to_optimizer_state", "scale_gradients", "broadcast_params",
    "install_optimized_model_weights", "all_gather_and_wait_parameters_ready",
    # Megatron-Core's expert-parallel overlap schedule drives the layers by hand (hand_driven.py)
    "_replace_param_with_raw_if_needed", "pre_backward", "post_backward", "post_forward_release_module",
    "post_backward_release_module"})
"""Megatron-FSDP's ``MegatronFSDP`` members flatfsdp answers (no_sync is FSDPModule's own;
finish_grad_sync, FSDPModule's too, is overridden by MegatronMembers' own, a superset)."""
_WRITABLE = frozenset({"model_auto_sync", "microbatch_count"})


class MegatronMembers:
    """Put first in the root's class by ``adopt_megatron_members``; it only
    routes names (Megatron's members are on ``MegatronView``)."""

    def __getattr__(self, name: str) -> Any:
        if name not in MEMBERS:
            return super().__getattr__(name)
        try:
            return super().__getattr__(name)  # the module's own parameter, buffer or sub-module wins
        except AttributeError:
            view = self.__dict__.get("_flatfsdp_megatron")
            if view is None:
                raise
            return getattr(view, name)

    def __setattr__(self, name: str, value: Any) -> None:
        view = self.__dict__.get("_flatfsdp_megatron")
        if view is not None and name in _WRITABLE and name not in self.__dict__ and not hasattr(type(self), name):
            setattr(view, name, value)
            return
        super().__setattr__(name, value)

    def __dir__(self):
        return sorted(set(super().__dir__()) | MEMBERS)

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        """Megatron-FSDP's (``MegatronView.finish_grad_sync``), where FSDPModule
        has its own: it does what FSDPModule's does (wait for the reductions in
        flight) and also reduces what backwards accumulated without communicating."""
        self.__dict__["_flatfsdp_megatron"].finish_grad_sync(force_all_reduce)


class FsdpParamMarker:
    """Megatron-LM's optimizer and gradient clipping ask
    ``getattr(param, "__fsdp_param__", False)`` to find parameters whose
    ``.grad`` is a DTensor shard: this is that marker (truthy), set on the
    DTensors flatfsdp made for the optimizer -- never on the user's
    parameters -- and it names the model, so ``fully_shard_optimizer(opt)``
    finds the model without a registry, and the parameter the user made that
    this DTensor stands in for (what Megatron-FSDP calls ``orig_param``). It
    pickles and copies as ``True``."""

    def __init__(self, view: "MegatronView", original: nn.Parameter | None = None):
        self._view = weakref.ref(view)
        self._original = weakref.ref(original) if original is not None else None

    def __bool__(self) -> bool:
        return True

    def __reduce__(self):
        return (bool, (True,))

    @property
    def view(self) -> "MegatronView | None":
        return self._view()

    @property
    def original(self) -> nn.Parameter | None:
        return self._original() if self._original is not None else None


def adopt_megatron_members(model: nn.Module, given: GivenKeywords, options: ShardOptions, classes: tuple) -> None:
    """Give the root of a one-call sharding Megatron-FSDP's members."""
    view = MegatronView(model, given, options, classes)
    model.__dict__["_flatfsdp_megatron"] = view
    swap_class(model, MegatronMembers)
    for state in view.states():
        for group in state.groups:
            for original, param in zip(group.originals(), group.sharded_params):
                param.__fsdp_param__ = FsdpParamMarker(view, original)


def hand_module_to_wrapper(model: nn.Module) -> None:
    """A wrapper module (``flatfsdp.megatron_fsdp.MegatronFSDP``) holds this
    one-call-sharded model as its ``.module``: the model stops answering
    ``.module`` itself (a chain of ``.module`` must end, as Megatron-Core's
    ``get_attr_wrapped_model`` walks it); every other member stays."""
    view = model.__dict__.get("_flatfsdp_megatron")
    if view is None:
        raise TypeError(f"{type(model).__name__} was not sharded by the one-call form (fully_shard_model)")
    view._held_by_wrapper = True


def megatron_views_of(params) -> list["MegatronView"]:
    """The Megatron views of the models these (sharded) parameters belong to."""
    found: dict[int, MegatronView] = {}
    for param in params:
        marker = getattr(param, "__fsdp_param__", None)
        view = marker.view if isinstance(marker, FsdpParamMarker) else None
        if view is not None:
            found.setdefault(id(view), view)
    return list(found.values())


class MegatronView:
    """Megatron-FSDP's ``MegatronFSDP`` members, on a model flatfsdp sharded."""

    def __init__(self, model: nn.Module, given: GivenKeywords, options: ShardOptions, classes: tuple):
        self._model = weakref.ref(model)
        self.ddp_config = DistributedDataParallelConfig.from_keywords(given, options)
        self.dist_index = DistributedIndex(given, options)
        self.device = mesh_device(options.mesh.shard)
        self.fsdp_unit_modules = list(classes)
        self.data_parallel_sharding_strategy = self.ddp_config.data_parallel_sharding_strategy
        policy = given.mixed_precision_policy
        self._policy = policy if policy is not None else given.mp_policy
        self._engine_policy = options.policy
        self._auto_sync = bool(given.sync_model_each_microbatch)
        self._backwards_at_sync = 0
        self._experts = options.expert_mesh is not None
        self._held_by_wrapper = False  # hand_module_to_wrapper: a MegatronFSDP wrapper answers .module
        self._driven_by_hand = False  # a step of Megatron-Core's EP-overlap schedule is under way (hand_driven.py)

    @property
    def sharded_model(self) -> nn.Module:
        """The model this view belongs to (whatever ``.module`` answers)."""
        return self._model()

    # ---- what the model is --------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The model: flatfsdp shards it in place, so it is its own module --
        unless a ``MegatronFSDP`` wrapper holds it (``hand_module_to_wrapper``):
        then the model has no ``.module``, as a stock-wrapped model has none,
        and Megatron-Core's unwrapping loops stop at it."""
        if self._held_by_wrapper:
            raise AttributeError("module: a MegatronFSDP wrapper holds this model; the wrapper's .module is it")
        return self._model()

    def states(self) -> list:
        return unit_states(self._model())

    def get_distributed_index(self) -> DistributedIndex:
        return self.dist_index

    @property
    def mp_policy(self) -> Any:
        """The policy as given (Megatron-FSDP's, flatfsdp's or torch's); the engine's reading is fixed."""
        return self._policy if self._policy is not None else self._engine_policy

    @property
    def param_and_grad_buffer(self) -> ParamAndGradBufferView:
        model = self._model()
        names = {id(p): n for n, p in model.named_parameters()}
        experts = {id(p) for p in model.parameters() if self._experts and is_expert(p)}
        return ParamAndGradBufferView(self, self.states(), names, experts, self._engine_policy.main_params_dtype)

    # ---- gradient synchronisation --------------------------------------------------------

    @property
    def model_auto_sync(self) -> bool:
        return self._auto_sync

    @model_auto_sync.setter
    def model_auto_sync(self, value: bool) -> None:
        self.set_model_auto_sync(value)

    def set_model_auto_sync(self, sync_model: bool = True) -> None:
        """True: each backward reduces its gradients and hands them to the
        optimizer as it ends. False: backwards accumulate without communicating
        (FSDP2's ``set_requires_gradient_sync(False)``) until a backward with
        True, or ``finish_grad_sync()`` (a bound optimizer's step calls it)."""
        if self._auto_sync and not sync_model:
            self._backwards_at_sync = self._backwards()  # micro-batches are counted from here
        self._auto_sync = bool(sync_model)
        for state in self.states():
            state.requires_grad_sync = self._auto_sync

    @contextlib.contextmanager
    def sync(self) -> Iterator[None]:
        """Synchronise every backward inside; auto-sync is off afterwards (as Megatron-FSDP's)."""
        self.set_model_auto_sync(True)
        try:
            yield
        finally:
            self.set_model_auto_sync(False)

    @property
    def microbatch_count(self) -> int:
        """Backwards since the last ``finish_grad_sync`` (0 under auto-sync,
        where every backward finishes its own synchronisation)."""
        return 0 if self._auto_sync else self._backwards() - self._backwards_at_sync

    @microbatch_count.setter
    def microbatch_count(self, value: int) -> None:
        self._backwards_at_sync = self._backwards() - int(value)

    def _backwards(self) -> int:
        context = self._context()
        return context.nonfinite.backwards if context is not None else 0

    def _context(self):
        states = self.states()
        return states[0].context if states else None

    def start_grad_sync(self, *unused) -> None:
        """Start reducing the gradients accumulated without communication (in flight on return)."""
        for state in reversed(self.states()):
            previous, state.requires_grad_sync = state.requires_grad_sync, True
            try:
                state.reduce_accumulated()
            finally:
                state.requires_grad_sync = previous

    def synchronize_gradient_reduce(self) -> None:
        """Wait for every reduction in flight (and the replicas' all-reduce
        owed by deferred ones): every ``.grad`` is final."""
        context = self._context()
        if context is not None:
            context.wait_reductions()
        for state in self.states():
            for group in state.groups:
                group.complete_reduction()

    attach_grad_to_optimizer_state = synchronize_gradient_reduce

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        """Reduce what is still unreduced, wait for it all, and hand the
        optimizer its gradients; the micro-batch count starts again.
        ``force_all_reduce`` is accepted as Megatron-FSDP accepts it (for DDP's API) and changes nothing."""
        self.start_grad_sync()
        self.synchronize_gradient_reduce()
        self._backwards_at_sync = self._backwards()
        if self._driven_by_hand:  # the step's gradients are in: its weights go, the next use gathers the stepped ones
            hand_driven.finish(self._model())
            self._driven_by_hand = False

    # ---- a step whose layers Megatron-Core's EP-overlap schedule drives by hand (hand_driven.py) ----

    def _replace_param_with_raw_if_needed(self) -> None:
        """The schedule calls the layers' sub-modules itself from here on:
        every unit is gathered (freshly) and stays so until ``finish_grad_sync``."""
        model = self._model()
        hand_driven.finish(model)
        hand_driven.begin(model)
        self._driven_by_hand = True

    def pre_backward(self) -> None:
        """A backward the schedule runs by hand begins: the weights are already there."""

    def post_backward(self) -> None:
        """That backward has ended: its gradients are taken and reduced (under the
        gradient-sync setting), as the end of a backward takes them."""
        hand_driven.end_backward(self._model())

    def post_forward_release_module(self, module: nn.Module) -> None:
        """A layer's forward is done: its weights stay -- its backward comes later,
        with no hook of its own to gather them again (released at finish_grad_sync)."""

    def post_backward_release_module(self, module: nn.Module) -> None:
        """A layer's backward is done: its weights stay until finish_grad_sync (as above)."""

    def zero_grad_buffer(self, keep_grads: bool = False, params=None) -> None:
        """Forget this step's gradients: accumulated, in flight, reduced; ``.grad``
        becomes None (``keep_grads``: stays, zeroed -- an optimizer's
        ``zero_grad(set_to_none=False)`` asked for that). ``params``: only the
        groups whose parameters are all among them (a bound optimizer's
        zero_grad: another optimizer may step the rest of the model, and a
        group's gradients are one buffer)."""
        ids = None if params is None else {id(p) for p in params}
        for state in self.states():
            for group in state.groups:
                if ids is None or all(id(p) in ids for p in group.sharded_params):
                    group.discard_grads(keep_grads)

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every gradient held (reduced or still accumulating) by ``scaling_factor``."""
        for state in self.states():
            for group in state.groups:
                group.scale_grads(scaling_factor)

    # ---- weights ---------------------------------------------------------------------------

    def install_optimized_model_weights(self) -> None:
        """The main weights changed: the model weights follow before their next
        use (each group re-casts and re-gathers once, however often this is called)."""
        for state in self.states():
            for group in state.groups:
                group.note_weights_written()

    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """``force_sync`` (or ``overlap_param_gather=False``): bring every kept
        copy of the model weights (ZeRO-0/1/2) up to date with the main weights
        now. Otherwise gathers start with the forward, the next unit prefetched
        (``force_dispatch`` changes nothing: there is nothing queued to dispatch)."""
        if not (force_sync or not self.ddp_config.overlap_param_gather):
            return
        for state in self.states():
            if any(g.placement.keep_model_weights for g in state.groups):
                state.module.unshard()
                state.module.reshard()

    def synchronize_param_gather(self) -> None:
        """Wait for gathers in flight (prefetches)."""
        for state in self.states():
            state.wait_unshard()

    def all_gather_and_wait_parameters_ready(self, params, prefetch: bool = True, prefetch_order: Any = None,
                                             wait_bucket_ready: bool = True, bwd: bool = False) -> None:
        """Gather the units holding ``params`` (they stay gathered until their
        next forward or backward releases them, or ``reshard()``)."""
        ids = {id(p) for p in params}
        for state in self.states():
            if any(id(p) in ids for g in state.groups for p in list(g.params) + list(g.sharded_params)):
                handle = state.module.unshard(async_op=not wait_bucket_ready)
                if handle is not None and wait_bucket_ready:
                    handle.wait()

    def broadcast_params(self) -> None:
        """Every replica takes the first rank's main weights (NO_SHARD groups
        and scalars within the shard group, HSDP across the outer one); chunks
        of sharded groups have no replica to agree with."""
        for state in self.states():
            for group in state.groups:
                group.broadcast_from_first_replica()
                group.note_weights_written()

    # ---- mixed precision -------------------------------------------------------------------

    def reset_mixed_precision_policy(self, mixed_precision_policy: Any) -> None:
        """As Megatron-FSDP 0.6.1 does without NCCL user buffers: the main
        weights' and grads' dtypes stay, and so does the gradient
        communication dtype -- flatfsdp allocated the reduction buffers in it.
        A different ``grad_comm_dtype`` is named in a warning, not taken."""
        policy = mixed_precision_policy
        # flatfsdp's and torch's policies name it reduce_dtype, Megatron-FSDP's grad_comm_dtype.
        wanted = getattr(policy, "reduce_dtype" if hasattr(policy, "param_dtype") else "grad_comm_dtype", None)
        current = self._engine_policy.reduce_dtype or self._engine_policy.main_grads_dtype
        if wanted is not None and wanted != current:
            warnings.warn(f"reset_mixed_precision_policy: gradients keep being reduced in "
                          f"{current or 'the parameters dtype'}, fixed when the model was sharded; the new policy's "
                          f"grad_comm_dtype={wanted} is not taken (Megatron-FSDP 0.6.1 keeps it too, unless NCCL "
                          "user buffers are on)", stacklevel=3)

    @contextlib.contextmanager
    def mixed_precision_context(self, mixed_precision_policy: Any) -> Iterator[None]:
        self.reset_mixed_precision_policy(mixed_precision_policy)
        yield

