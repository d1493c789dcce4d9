"""The class a sharded module becomes: its own class plus FSDP controls, as in
PyTorch FSDP2, so ``isinstance`` checks and the module's behaviour survive.

Every ``set_*`` method writes one field of the unit's ``UnitControls`` (see
unit_controls.py for what each means); the runtime reads them."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
from torch import nn

from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from flatfsdp.engine.runtime.class_swap import swap_class
from flatfsdp.engine.runtime.conversion import convert_sharded
from flatfsdp.engine.runtime.torch_fsdp2_view import Fsdp2StateView, file_torch_state
from flatfsdp.engine.comm.user_comms import check_comm
from flatfsdp.engine.runtime.unit_state import UnitState
from flatfsdp.engine.runtime.unit_controls import lookup_rows_refusal, rows_all_local


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``: ``wait()`` blocks until the
    gathered weights may be used (the module's forward waits by itself)."""

    def __init__(self, state: UnitState | None):
        self._state = state

    def wait(self) -> None:
        if self._state is not None:
            self._state.wait_unshard()
            self._state = None


# torch 2.15 added the handle type; on older torch ours stands alone (same method).
_TorchGradientReductionHandle = getattr(torch.distributed.fsdp, "GradientReductionHandle", object)


class GradientReductionHandle(_TorchGradientReductionHandle):
    """Returned by ``finalize_backward(async_op=True)``: ``wait()`` blocks until
    the gradient reductions landed, and ends the backward iteration. Wait
    before reading the gradients or running the model again."""

    def __init__(self, context: Any):
        self._context = context

    def wait(self) -> None:
        context, self._context = self._context, None
        if context is not None:
            context.end_backward_iteration()


class FSDPModule(TorchFSDPModule):
    """Mixin added to every sharded unit's class. Methods act on this unit and,
    where they take ``recurse``, on the sharded units below it.

    It subclasses torch's ``FSDPModule``, so code that asks
    ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` -- torch's pipeline
    schedules, ``register_fsdp_forward_method``, user loops -- treats a
    flatfsdp unit as the FSDP2 unit it replaces; every method torch's class
    has is implemented here on this engine."""

    _flatfsdp_state: UnitState
    _orig_cls_mro_index = 3  # FSDP<Class>, this class, torch's FSDPModule, Class

    def _get_fsdp_state(self) -> Fsdp2StateView:
        """What torch's helpers (``register_fsdp_forward_method``) call into."""
        return Fsdp2StateView(self._flatfsdp_state)

    def _apply(self, fn, recurse: bool = True):
        """``.to(dtype / device)``, ``.to_empty()``, ``.double()``: convert the
        sharded parameters and keep them sharded (see conversion.py)."""
        # past torch's FSDP2 version, to nn.Module's
        return convert_sharded(self._flatfsdp_state, self, lambda: super(TorchFSDPModule, self)._apply(fn, recurse))

    def to_empty(self, *, device: Any, recurse: bool = True):
        """As torch's: the sharded parameters get uninitialised storage on
        ``device``. The caller then initialises them (FSDP2's meta-device
        recipe: ``to_empty``, then the model's own init), so flatfsdp's
        deferred ``reset_parameters()`` initialisation of these units is
        dropped -- at the first forward it would overwrite the caller's values."""
        result = super().to_empty(device=device, recurse=recurse)
        for state in self._states(recurse):
            state.deferred.drop()
        return result

    # ---- gather / release ---------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this unit's parameters now (e.g. before calling a method other
        than forward). ``async_op=True`` returns a handle to wait on."""
        state = self._flatfsdp_state
        state.unshard(async_op=async_op)
        if async_op:
            return UnshardHandle(state)
        state.wait_unshard()
        return None

    def reshard(self) -> None:
        """Release the gathered parameters; the module shows its sharded DTensors again."""
        self._flatfsdp_state.reshard()

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """True: releasing the gathered weights keeps their storage, so every
        gather lands at the same addresses (CUDA graph capture), at the cost
        of holding the unsharded weights throughout."""
        _require_bool("set_keep_unsharded_storage", keep)
        for state in self._states(recurse):
            state.controls.keep_unsharded_storage = keep

    def reset_iter_state(self) -> None:
        """After an exception cut a forward or backward short: forget that step
        (called on the root)."""
        state = self._flatfsdp_state
        if state.context is not None and not state.is_root:
            raise RuntimeError(f"reset_iter_state() must be called on the root sharded module, not on "
                               f"'{state.path}' ({type(self).__name__})")
        if state.context is not None:
            state.context.reset_iter_state()

    # ---- gradient synchronisation ------------------------------------------------------

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """True (on the root): the end of a backward neither waits for gradient
        reductions nor starts those of units whose hooks did not fire; call
        ``finalize_backward`` after the last backward of the step (FSDP2's
        contract: torch 2.15's pipeline stages do). Set it before backward."""
        _require_bool("set_manual_backward_finalization", enabled)
        state = self._flatfsdp_state
        if state.context is not None and not state.is_root:
            raise RuntimeError(f"set_manual_backward_finalization must be called on the root sharded module, not "
                               f"on '{state.path}' ({type(self).__name__})")
        context = state.context
        if context is not None and context.manual_finalization_active not in (None, enabled):
            raise RuntimeError("set_manual_backward_finalization cannot change mode after backward starts; "
                               "finalize_backward (or reset_iter_state) first")
        state.controls.manual_backward_finalization = enabled

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """After the last backward (manual finalization on): reduce the
        gradients accumulated but not yet reduced (where gradient sync is on),
        release weights as ``set_reshard_after_backward`` says, and wait for
        every reduction -- or, with ``async_op=True``, return a handle whose
        ``wait()`` does. A no-op before the first forward."""
        state = self._flatfsdp_state
        context = state.context
        if context is None:
            return GradientReductionHandle(None) if async_op else None
        if not state.is_root:
            raise RuntimeError(f"finalize_backward must be called on the root sharded module, not on "
                               f"'{state.path}' ({type(self).__name__})")
        if context.reduction_pending:
            raise RuntimeError("the previous finalize_backward(async_op=True) handle must be waited on before "
                               "finalizing backward again")
        manual = context.manual_finalization_active
        if not (state.controls.manual_backward_finalization if manual is None else manual):
            raise RuntimeError("finalize_backward requires manual backward finalization: call "
                               "set_manual_backward_finalization(True) on the root before forward")
        if context.in_backward:
            raise RuntimeError("finalize_backward must be called after backward completes")
        context.finalize_backward()
        if not async_op:
            context.end_backward_iteration()
            return None
        context.reduction_pending = True
        return GradientReductionHandle(context)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward accumulates unsharded gradients locally and communicates
        nothing; the next backward with True reduces the sum once."""
        for state in self._states(recurse):
            state.requires_grad_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Hybrid meshes: whether gradients are all-reduced across replicas
        after this backward's reduce-scatter (a 1-D mesh has none, so this
        changes nothing there). False: the reduced chunks keep summing without
        it, and the next backward with True all-reduces the sum once."""
        for state in self._states(recurse):
            state.controls.requires_all_reduce = requires_all_reduce

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: more microbatches follow before the optimizer step, so the
        backward's end does not wait for its gradient reductions."""
        for state in self._states(True):
            state.controls.is_last_backward = is_last_backward

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation without communication inside the block."""
        states = list(self._states(True))
        previous = [s.requires_grad_sync for s in states]
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for state, value in zip(states, previous):
                state.requires_grad_sync = value

    def finish_grad_sync(self) -> None:
        """Wait for gradient reductions still in flight (needed only with
        ``sync_model_each_microbatch=False``; optimizers bound by
        ``fully_shard_optimizer`` do it before stepping)."""
        context = self._flatfsdp_state.context
        if context is not None:
            context.wait_reductions()

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's summed gradients by ``factor`` instead of the
        data-parallel size. This unit only, as in FSDP2: the units below keep
        their own factor (set it on each to change them all)."""
        if not factor > 0:
            raise ValueError(f"the gradient divide factor must be positive, got {factor!r}")
        self._flatfsdp_state.controls.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Old name of ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Call ``hook`` on each of this unit's reduced gradient shards (flat,
        this rank's part) once it lands; it may modify it in place. This unit
        only, as in FSDP2."""
        self._flatfsdp_state.controls.all_reduce_hook = hook

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """True: a parameter without a gradient on this rank is reduced as a
        zero gradient, so every rank gets a ``.grad`` for every parameter of
        the unit. Needed when ranks use different parameters (expert routing,
        conditional branches): without it, only the ranks that used a
        parameter step their chunk of it."""
        for state in self._states(recurse):
            state.controls.reduce_scatter_unused_params = bool(reduce_scatter_unused_params)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """The engine's own reductions always sum and divide afterwards
        (FSDP2's behaviour with ``True``); what this changes is the op a user's
        ``set_custom_reduce_scatter`` is called with: SUM, never AVG."""
        _require_bool("set_force_sum_reduction_for_comms", enable)
        self._flatfsdp_state.controls.force_sum_reduction = enable

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted for FSDP2 scripts; changes nothing here (an allocation
        hint): gathers of 4 MiB or more land straight in the buffer the
        parameters view, so there is no separate staging buffer to place."""
        _require_bool("set_allocate_memory_from_process_group_for_comm", enable)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Accepted for FSDP2 scripts; changes nothing here (an allocation
        hint, as ``set_allocate_memory_from_process_group_for_comm``)."""
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm supports backend='NCCL' only, got {backend!r}")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Accepted for FSDP2 scripts; changes nothing here: reductions
        already run on their own stream, and values do not depend on which
        communicator carries them."""
        _require_bool("set_separate_reduce_scatter_group", enable)

    def set_custom_all_gather(self, comm: Any) -> None:
        """This unit's gathers run through ``comm`` (FSDP2's ``AllGather``: its
        ``allocate`` for the output, its call for the collective; comm/user_comms.py)."""
        check_comm(comm, "all_gather", self._flatfsdp_state.path or "<root>")
        for group in self._flatfsdp_state.groups:
            group.use_custom_all_gather(comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """This unit's gradient reduce-scatters run through ``comm`` (FSDP2's ``ReduceScatter``)."""
        check_comm(comm, "reduce_scatter", self._flatfsdp_state.path or "<root>")
        for group in self._flatfsdp_state.groups:
            group.use_custom_reduce_scatter(comm)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many gradient reductions may be in flight at once (each holds an
        unsharded gradient buffer); the largest value of any unit applies."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for state in self._states(recurse):
            state.controls.reduce_scatter_max_input_buffers = max_input_buffers
            if state.context is not None:
                state.context.reductions.max_in_flight = max(state.context.reductions.max_in_flight,
                                                             max_input_buffers)

    # ---- when weights are gathered and released ---------------------------------------

    def set_reshard_after_forward(self, reshard_after_forward: bool | None, *, recurse: bool = True) -> None:
        """False keeps the unit gathered from its forward to its backward: one
        all-gather fewer per step, its full weights held meanwhile. True always
        releases (the root too). None (the default): release, except the root
        and the unit that runs last in forward, whose backward follows at once."""
        if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for state in self._states(recurse):
            state.controls.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False keeps the weights gathered after backward (gradient
        accumulation: the next microbatch's forward needs no all-gather)."""
        for state in self._states(recurse):
            state.controls.reshard_after_backward = reshard_after_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: this unit's backward does not need its weights (it is not
        gathered for it)."""
        self._flatfsdp_state.controls.unshard_in_backward = unshard_in_backward

    def set_lookup_rows_only(self, lookup_rows_only: bool) -> None:
        """True, on one ``nn.Embedding`` sharded ZeRO-3: its forward gathers, and its
        gradient reduction sends, only the rows the ranks' ids touch (docs/fsdp2.md);
        accepted, changing nothing, where every row is here (rows_all_local)."""
        state = self._flatfsdp_state
        lookup_rows_only = lookup_rows_only and not rows_all_local(state)
        if lookup_rows_only and (reason := lookup_rows_refusal(state)) is not None:
            raise ValueError(f"set_lookup_rows_only: unit '{state.path or type(self).__name__}' cannot "
                             f"gather rows only: {reason}")
        state.controls.lookup_rows_only = bool(lookup_rows_only)
        for group in state.groups:  # its gradient: only the looked-up rows travel
            group.reduce_rows_only(bool(lookup_rows_only))

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Start gathering these units when this one's forward starts (instead
        of the next one in the recorded order)."""
        self._flatfsdp_state.controls.forward_prefetch = _states_of(modules)

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Start gathering these units when this one's backward starts (instead
        of the previous one in forward order)."""
        self._flatfsdp_state.controls.backward_prefetch = _states_of(modules)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next gather of this unit waits for ``event`` (recorded at the
        end of an optimizer step run on another stream) instead of the whole
        compute stream."""
        self._flatfsdp_state.controls.post_optim_event = event

    def _set_unshard_async_op(self, async_op: bool) -> None:
        for state in self._states(True):
            state.controls.unshard_async_op = async_op

    def _states(self, recurse: bool) -> Iterator[UnitState]:
        if not recurse:
            yield self._flatfsdp_state
            return
        seen = set()
        for module in self.modules():  # type: ignore[attr-defined]
            state = getattr(module, "_flatfsdp_state", None)
            if state is not None and id(state) not in seen:
                seen.add(id(state))
                yield state


def _require_bool(method: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{method} takes a bool, got {type(value).__name__}")


def _states_of(modules: list) -> list[UnitState]:
    bad = [type(m).__name__ for m in modules if not isinstance(m, FSDPModule)]
    if bad:
        raise ValueError(f"prefetch lists take sharded modules (FSDPModule), got {bad}")
    return [m._flatfsdp_state for m in modules]


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` gather and release like ``forward``
    (e.g. ``generate`` or a VAE's ``encode``). A no-op on a plain module."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")
    method = getattr(module, method_name)
    if getattr(method, "_flatfsdp_wrapped", False):
        return
    state = module._flatfsdp_state

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        args, kwargs = state.pre_forward(module, args, kwargs)
        out = method(*args, **kwargs)
        return state.post_forward(module, args, kwargs, out)

    wrapped._flatfsdp_wrapped = True
    # The instance attribute shadows the class's method for this module only,
    # as the user asked; the class is untouched.
    setattr(module, method_name, wrapped)


def become_fsdp_module(module: nn.Module, state: UnitState) -> None:
    """Swap the instance's class for ``FSDP<Class>``."""
    module._flatfsdp_state = state
    swap_class(module, FSDPModule, prefix="FSDP")
    file_torch_state(module, state)
