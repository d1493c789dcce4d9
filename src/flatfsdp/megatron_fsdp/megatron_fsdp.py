"""``MegatronFSDP``: the wrapper module Megatron-Core's adapter builds.

``MegatronFSDP(module, dist_index, ddp_config, mixed_precision_policy, ...)``
takes megatron_fsdp 0.6.1's arguments, shards ``module`` in place with
``flatfsdp.fully_shard_model`` and holds it as ``.module``, as stock does: the
wrapper's state-dict keys are ``module.``-prefixed like stock's, and
Megatron-Core's ``.module`` unwrapping ends at the user's model. Megatron-FSDP's
members (``finish_grad_sync``, ``zero_grad_buffer``, ``param_and_grad_buffer``,
``no_sync``, ...) are the sharded model's own (flatfsdp's one-call members,
docs/megatron.md), reached through the wrapper.

Every field of ``ddp_config`` is read through ``config_fields.FIELDS``; the
index's groups are checked against its mesh (``distributed_index.py``). The
constructor's parameters are the engine's table (``MEGATRON_FSDP_CLASS``), as
the front doors' are; its sharded parameters answer Megatron-FSDP's
``megatron_fsdp_slice`` / ``megatron_fsdp_dist_index`` (``sharded_params.py``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import flatfsdp.engine as engine
from flatfsdp.megatron_fsdp.config_fields import keywords_from_config, policy_from_config
from flatfsdp.megatron_fsdp.distributed_data_parallel_config import DistributedDataParallelConfig
from flatfsdp.megatron_fsdp.model_keys import checked_module_state_dict
from flatfsdp.megatron_fsdp.distributed_index import FSDPDistributedIndex
from flatfsdp.megatron_fsdp.sharded_params import give_megatron_members

DELEGATED = frozenset({
    "param_and_grad_buffer", "no_sync", "sync", "set_model_auto_sync", "get_distributed_index",
    "mixed_precision_context", "reset_mixed_precision_policy", "start_param_sync", "start_grad_sync",
    "synchronize_param_gather", "synchronize_gradient_reduce", "attach_grad_to_optimizer_state",
    "finish_grad_sync", "scale_gradients", "zero_grad_buffer", "install_optimized_model_weights",
    "broadcast_params", "all_gather_and_wait_parameters_ready", "pre_backward", "post_backward",
    "post_forward_release_module", "post_backward_release_module"})
"""Members the sharded model answers (flatfsdp's one-call members) and the wrapper passes on."""

_SELF = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
_MODULE = inspect.Parameter("module", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="nn.Module")
_CONSTRUCTOR = engine.Door("MegatronFSDP", (_SELF, _MODULE), engine.MEGATRON_FSDP_CLASS, (), aliases=False)
"""megatron_fsdp's constructor signature, from the engine's keyword table."""


class MegatronFSDP(nn.Module):
    @_CONSTRUCTOR.takes
    def __init__(self, module: nn.Module, *args: Any, **kwargs: Any):
        super().__init__()
        given = _CONSTRUCTOR.record(args, kwargs)
        ddp_config, device = given.ddp_config, given.device
        if ddp_config is None:  # megatron_fsdp's default: full sharding, the constructor's switches
            switches = {k.ddp_field: getattr(given, k.name) for k in engine.MEGATRON_FSDP_CLASS if k.ddp_field}
            switches["fsdp_double_buffer"] = given.fsdp_double_buffer or given.nccl_ub
            ddp_config = DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params",
                                                       overlap_grad_reduce=True, overlap_param_gather=True, **switches)
        keywords = keywords_from_config(ddp_config)
        dist_index = given.dist_index if given.dist_index is not None else _world_index(device)
        _check_outer_strategy(dist_index, keywords)
        policy = given.mixed_precision_policy
        policy = policy if policy is not None else policy_from_config(ddp_config)
        keywords["report_nan_in_param_grad"] = bool(keywords["report_nan_in_param_grad"]
                                                    or given.report_nan_in_param_grad)
        # The fine-grained hooks gather sub-modules one by one (MXFP8 recompute, MoE overlap); a unit
        # is gathered whole here, with the same values (front/keywords.py's no-op of the same name).
        fine_grained = bool(given.enable_fine_grained_param_gather_hook
                            or given.enable_fine_grained_param_gather_backward_hook)
        keywords["enable_fine_grained_param_gather"] = bool(keywords["enable_fine_grained_param_gather"]
                                                            or fine_grained)
        engine.fully_shard_model(
            module, device_mesh=dist_index.device_mesh, dp_shard_dim=dist_index.dp_shard_dim,
            dp_outer_dim=dist_index.dp_outer_dim, tp_dim=dist_index.tp_dim,
            hybrid_fsdp_group=dist_index.hybrid_fsdp_group, expt_device_mesh=dist_index.expt_device_mesh,
            fsdp_group_ag=dist_index.fsdp_group_ag, **_expert_groups(dist_index),
            fsdp_unit_modules=_present_units(module, given.fsdp_unit_modules), device=device,
            init_model_with_meta_device=given.init_model_with_meta_device, mixed_precision_policy=policy,
            sync_model_each_microbatch=given.sync_model_each_microbatch, disable_bucketing=given.disable_bucketing,
            calculate_per_token_loss=given.calculate_per_token_loss, **keywords)
        engine.hand_module_to_wrapper(module)
        give_megatron_members(module)  # megatron_fsdp_slice / _dist_index, orig_param, Megatron-Core's marks
        self.module = module
        self.ddp_config = ddp_config  # the config as given: a record (the engine read it once, above)
        self.dist_index = dist_index
        self.mp_policy = policy
        self.device = module.device
        self.fsdp_unit_modules = module.fsdp_unit_modules
        self.data_parallel_sharding_strategy = ddp_config.data_parallel_sharding_strategy
        self.calculate_per_token_loss = given.calculate_per_token_loss
        self.init_model_with_meta_device = given.init_model_with_meta_device

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in DELEGATED:
                return getattr(self._modules["module"], name)
            raise

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)

    @property
    def model_auto_sync(self) -> bool:
        return self._modules["module"].model_auto_sync

    @model_auto_sync.setter
    def model_auto_sync(self, value: bool) -> None:
        self._modules["module"].set_model_auto_sync(value)

    @property
    def microbatch_count(self) -> int:
        return self._modules["module"].microbatch_count

    @microbatch_count.setter
    def microbatch_count(self, value: int) -> None:
        self._modules["module"].microbatch_count = value

    def _replace_param_with_distributed_if_needed(self) -> None:
        """Stock swaps the module's raw parameters for its buffer's DTensors here,
        so that an optimizer built afterwards on ``model.parameters()`` steps the
        sharded ones (NeMo AutoModel calls it after ``fully_shard_model``). In
        flatfsdp the module's parameters are those DTensors from sharding on:
        what is left is to check that they still are -- a parameter some caller
        put in place of one since would be stepped by nobody -- and to say so,
        by name, rather than train it silently unsharded."""
        owned = dict(self._modules["module"].param_and_grad_buffer.optimizer_named_parameters)
        foreign = [name for name, p in self._modules["module"].named_parameters() if owned.get(name) is not p]
        if foreign:
            raise ValueError(f"{type(self.module).__name__}: parameter(s) {foreign[:5]} were replaced after "
                             "fully_shard_model; flatfsdp's module parameters are its sharded DTensors -- load "
                             "values into them (load_state_dict) instead of assigning new Parameters")

    def _replace_param_with_raw_if_needed(self) -> None:
        """Megatron-Core's EP-overlap schedule drives the layers by hand from here
        (with pre/post_backward and the two release members, passed on like the
        others): the engine's ``hand_driven.py`` says what each does here."""
        self._modules["module"]._replace_param_with_raw_if_needed()

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        """Keys as this wrapper writes them (``module.``-prefixed, as stock's) or
        as flatfsdp's one-call model writes them (unprefixed); checked whole
        against this model first, so a state dict of another model is refused
        before anything is copied (model_keys.py)."""
        return super().load_state_dict(checked_module_state_dict(self, state_dict, strict), strict=strict,
                                       assign=assign)


def _expert_groups(dist_index: Any) -> dict:
    """The expert parameters' groups, where there are expert parameters: Megatron-Core's
    adapter passes its expert data-parallel group with HSDP even for a dense model
    (no ``expt_device_mesh``), and stock keeps it unused; the engine refuses an expert
    group without expert parameters, so it is passed only beside an expert mesh."""
    if dist_index.expt_device_mesh is None:
        return {}
    return {"hybrid_fsdp_expt_group": dist_index.hybrid_fsdp_expt_group,
            "expt_fsdp_group_ag": dist_index.expt_fsdp_group_ag}


def _world_index(device: torch.device | None) -> FSDPDistributedIndex:
    """megatron_fsdp's default: one data-parallel dimension over every rank."""
    kind = torch.device(device).type if device is not None else \
        ("cuda" if dist.get_backend() == "nccl" else "cpu")
    mesh = init_device_mesh(kind, (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    return FSDPDistributedIndex(device_mesh=mesh, dp_shard_dim="fsdp")


def _check_outer_strategy(dist_index: Any, keywords: dict) -> None:
    """HFSDP is asked for twice (the index's ``hsdp_outer_dp_shard``, the config's
    ``outer_dp_sharding_strategy``): the two must agree."""
    outer = str(keywords.get("outer_dp_sharding_strategy", "no_shard"))
    index_says = bool(getattr(dist_index, "hsdp_outer_dp_shard", False))
    if index_says != (outer not in ("no_shard", "0")):
        raise ValueError(f"dist_index.hsdp_outer_dp_shard={index_says} but ddp_config.outer_dp_sharding_strategy="
                         f"{outer!r}: they must agree (True with 'optim' for HFSDP, False with 'no_shard')")


def _present_units(module: nn.Module, entries: list | None) -> list:
    """The unit classes of which ``module`` has an instance, as stock reads the
    list: Megatron-Core names TransformerLayer, MoETransformerLayer and
    MambaLayer for every model. Import paths stay (the engine resolves them);
    if no class entry matches at all, all stay, and the engine's error names them."""
    entries = list(entries or ())
    classes = [e for e in entries if isinstance(e, type)]
    present = [c for c in classes if any(isinstance(m, c) for m in module.modules() if m is not module)]
    if classes and not present:
        return entries
    return [e for e in entries if not isinstance(e, type) or e in present]
