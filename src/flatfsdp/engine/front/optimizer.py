"""Bind an optimizer to a sharded model, keeping its param groups and their
hyperparameters.

Binding does three things, all through the optimizer's own hook API (nothing
process-wide, no attribute set on the optimizer):

* parameters the optimizer was built on before sharding are replaced by the
  DTensors that shard them;
* before each step it waits for gradient reductions still in flight
  (``sync_model_each_microbatch=False`` lets them overlap what follows backward);
* after each step it tells the parameters' groups that their main weights
  changed, so the next forward re-casts (bf16) and, for ZeRO-1/2, re-gathers
  them exactly once. (An unbound optimizer works too: the engine then assumes
  a step after every delivered gradient; see GroupCore.stamp.)

State the optimizer already holds (it stepped on the unsharded model) is
carried over to the sharded parameters, each rank its chunk
(optimizer_state.py), or refused by name -- never dropped.

Its ``state_dict()`` also creates the optimizer state if none exists yet, so
that loading a checkpoint into it in place (DCP) finds every slot. It numbers
parameters as torch does, in the optimizer's own order (what
``get_optimizer_state_dict`` names them by), and ``load_state_dict`` refuses,
by name and before anything is loaded, a state that does not fit
(optimizer_load_check.py).
"""

from __future__ import annotations

import torch
from torch import nn

from flatfsdp.engine.front.megatron_model import megatron_views_of
from flatfsdp.engine.front.megatron_optimizer import before_megatron_step, take_megatron_keywords
from flatfsdp.engine.front.optimizer_load_check import install_load_check
from flatfsdp.engine.front.optimizer_state import carry_state, check_carryable
from flatfsdp.engine.runtime.unit_state import unit_states


def fully_shard_optimizer(optimizer: torch.optim.Optimizer, preproc_state_dict_for_dcp_ckpt: bool = True, *,
                          model: nn.Module | None = None) -> torch.optim.Optimizer:
    """Bind ``optimizer`` to the sharded ``model``: every parameter it holds must
    be one of the model's (original or sharded). Nothing is stepped.

    Megatron-FSDP's signature: ``fully_shard_optimizer(optimizer)`` finds the
    model of a one-call sharding from the optimizer's parameters (their
    ``__fsdp_param__`` marker); ``preproc_state_dict_for_dcp_ckpt`` changes
    nothing (state dicts are always DCP-ready). flatfsdp's older
    ``fully_shard_optimizer(optimizer, model)`` still works: a module in the
    second place is the model. Bound to a one-call sharding, ``step`` takes
    ``sync_grad_before_optimizer_step=`` and ``install_optimized_model_weights=``
    and ``zero_grad`` takes ``zero_grad_buffer=`` (megatron_optimizer.py)."""
    if isinstance(preproc_state_dict_for_dcp_ckpt, nn.Module):
        if model is not None and model is not preproc_state_dict_for_dcp_ckpt:
            raise TypeError("fully_shard_optimizer got two different models")
        model = preproc_state_dict_for_dcp_ckpt
    elif not isinstance(preproc_state_dict_for_dcp_ckpt, bool):
        raise TypeError(f"fully_shard_optimizer's second argument is preproc_state_dict_for_dcp_ckpt (a bool) or "
                        f"the sharded model, got {type(preproc_state_dict_for_dcp_ckpt).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fully_shard_optimizer expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if model is None:
        model = _model_of(optimizer)
    sharded_of, group_of = _model_parameters(model)
    check_carryable(optimizer, sharded_of, group_of)
    covered = {}
    for gi, group in enumerate(optimizer.param_groups):
        bound = []
        for pi, param in enumerate(group["params"]):
            sharded = sharded_of.get(id(param))
            if sharded is None:
                raise ValueError(
                    f"optimizer param_groups[{gi}]['params'][{pi}] (shape {tuple(param.shape)}, {param.dtype}) "
                    f"is not a parameter of the sharded model {type(model).__name__}")
            if id(sharded) in group_of:
                owner = group_of[id(sharded)]
                covered[id(owner)] = owner
                carry_state(optimizer, param, sharded, owner)  # it may have stepped before sharding
            bound.append(sharded)
        group["params"] = bound
    new = [g for g in covered.values() if optimizer not in g.bound_optimizers]
    megatron = bool(megatron_views_of(p for g in optimizer.param_groups for p in g["params"]))
    if new:  # binding again (or to a second model) hooks only groups not yet covered
        _install_hooks(optimizer, new, megatron)
    install_load_check(optimizer, model, list(covered.values()))
    for g in new:
        g.bound_optimizers.add(optimizer)
    if megatron:
        take_megatron_keywords(optimizer)
    return optimizer


def _model_of(optimizer: torch.optim.Optimizer) -> nn.Module:
    """The one model a Megatron-style sharding made the optimizer's parameters for."""
    views = megatron_views_of(p for g in optimizer.param_groups for p in g["params"])
    if len(views) != 1:
        found = "parameters of several sharded models" if views else "no parameter of a model sharded by the " \
            "one-call form (fully_shard(model, fsdp_unit_modules=...) or fully_shard_model)"
        raise TypeError(f"fully_shard_optimizer(optimizer) finds the model from the optimizer's parameters, and "
                        f"this optimizer holds {found}: pass it, fully_shard_optimizer(optimizer, model=model)")
    return views[0].sharded_model


def _model_parameters(model: nn.Module) -> tuple[dict, dict]:
    """id(original, meta original or sharded parameter) -> sharded parameter, and
    id(sharded parameter) -> its param group; plain parameters map to themselves."""
    sharded_of: dict[int, nn.Parameter] = {id(p): p for p in model.parameters()}
    group_of = {}
    for state in unit_states(model):
        replaced = state.deferred.meta_of()
        for group in state.groups:
            for original, computed, sharded in zip(group.originals(), group.params, group.sharded_params):
                # A tensor-parallel parameter computes through a new DTensor;
                # an optimizer built before sharding names the one it replaced.
                sharded_of[id(original)] = sharded
                sharded_of[id(computed)] = sharded
                if id(original) in replaced:
                    sharded_of[id(replaced[id(original)])] = sharded
                group_of[id(sharded)] = group
    return sharded_of, group_of


def _install_hooks(optimizer: torch.optim.Optimizer, groups: list, megatron: bool) -> None:
    """``megatron``: the step also takes Megatron-FSDP's keywords (megatron_optimizer.py)."""
    def before_step(opt, args, kwargs):
        rewritten = (args, before_megatron_step(opt, kwargs)) if megatron else None
        for group in groups:
            group.complete_reduction()
        return rewritten

    def after_step(*_):
        for group in groups:
            group.note_weights_written()

    def create_state(opt):
        if not opt.state and any(p.requires_grad for g in opt.param_groups for p in g["params"]):
            from torch.distributed.checkpoint.state_dict import _init_optim_state
            _init_optim_state(opt)

    optimizer.register_step_pre_hook(before_step)
    optimizer.register_step_post_hook(after_step)
    optimizer.register_state_dict_pre_hook(create_state)
