"""Every keyword of the two front doors, written once: its name, its default,
and how the engine reads it -- or why it changes nothing here.

The doors' signatures are made from these tables (``Door``), so Megatron-FSDP's
positional order, its defaults and flatfsdp's keyword-only extras cannot
drift apart; a call's keywords arrive as one frozen ``GivenKeywords`` record,
where a name that is not a keyword is an ``AttributeError`` naming it, never
a silent None. ``ddp_config`` (front/megatron_buffers.DistributedDataParallelConfig) and
docs/megatron.md's table are checked against the same tables
(tests/test_megatron_api.py).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Keyword:
    """One front-door keyword."""

    name: str
    default: Any
    annotation: str
    """As the door's signature shows it."""
    reads: str = ""
    """How the engine reads it ("" for a no-op)."""
    no_op: str = ""
    """Why it changes nothing here ("" when it is read)."""
    ddp_field: str | None = None
    """The ``DistributedDataParallelConfig`` field it sets as given (megatron_buffers.DistributedDataParallelConfig), if any."""

    def __post_init__(self) -> None:
        if bool(self.reads) == bool(self.no_op):
            raise ValueError(f"keyword {self.name}: say how it is read or why it is a no-op, one of the two")


K = Keyword
_CUDA_NCCL = "(CUDA); flat buffers are allocated once anyway"

MEGATRON: tuple[Keyword, ...] = (
    K("device_mesh", None, "DeviceMesh | None", "the mesh (with dp_shard_dim / dp_outer_dim / tp_dim: its dimensions)"),
    K("dp_shard_dim", None, "str | None", "the dimension chunks are split over"),
    K("dp_outer_dim", None, "str | None", "HSDP's replica dimension"),
    K("tp_dim", None, "str | None", "checked to be a dimension of the mesh (DTensor parameters carry their own mesh)"),
    K("hybrid_fsdp_group", None, "ProcessGroup | None", "checked against dp_outer x dp_shard"),
    K("hybrid_fsdp_expt_group", None, "ProcessGroup | None",
      no_op="the expert parameters' groups come from expt_device_mesh (checked to be a process group)"),
    K("expt_device_mesh", None, "DeviceMesh | None", "expert parameters' mesh"),
    K("fsdp_group_ag", None, "ProcessGroup | None",
      no_op="a second NCCL communicator for gathers beside reductions; gathers and reductions already run on "
            "their own streams (checked to be a process group)"),
    K("expt_fsdp_group_ag", None, "ProcessGroup | None", no_op="as fsdp_group_ag, for expert parameters"),
    K("fsdp_unit_modules", None, "Iterable[type | str] | None", "the units"),
    K("zero_dp_strategy", 3, "ShardingStrategy | int | str", "ZeRO-0..3"),
    K("outer_dp_sharding_strategy", 0, "int | str", "HFSDP (optim) or HSDP (no_shard)"),
    K("device", None, "torch.device | None", "checked to agree with the mesh"),
    K("init_model_with_meta_device", False, "bool",
      "a confirmation: flatfsdp finds meta parameters itself and initialises them unit by unit "
      "(reset_parameters(), else _reset_parameters())"),
    K("mixed_precision_policy", None, "MixedPrecisionPolicy | None",
      "layout/precision.from_megatron_policy, field by field"),
    K("overlap_grad_reduce", True, "bool",
      no_op="reductions always overlap the backward (a side stream, a bounded queue)", ddp_field="overlap_grad_reduce"),
    K("overlap_param_gather", True, "bool", no_op="gathers always overlap compute (prefetch of the next unit)",
      ddp_field="overlap_param_gather"),
    K("sync_model_each_microbatch", True, "bool",
      "reductions waited each backward, or left in flight for the step"),
    K("preproc_state_dict_for_dcp_ckpt", True, "bool",
      no_op="state dicts are always DCP-ready: every DTensor says what it holds"),
    K("report_nan_in_param_grad", False, "bool", "NaN/inf gradients raise NonFiniteError (on_nonfinite='error')",
      ddp_field="check_for_nan_in_grad"),
    K("average_in_collective", False, "bool",
      no_op="reductions sum, then divide once by the data-parallel size: the average the collective would take "
            "(gloo has no AVG), and the same for expert parameters", ddp_field="average_in_collective"),
    K("disable_bucketing", False, "bool", "no coalescing of small collectives (bucket_bytes=0)"),
    K("calculate_per_token_loss", False, "bool", "gradients summed, not averaged over data-parallel ranks"),
    K("keep_fp8_transpose_cache", False, "bool", no_op="TransformerEngine FP8 weights only (CUDA)",
      ddp_field="keep_fp8_transpose_cache"),
    K("nccl_ub", False, "bool", no_op="NCCL user-buffer registration (CUDA)", ddp_field="nccl_ub"),
    K("fsdp_double_buffer", False, "bool", no_op=f"a persistent NCCL double buffer {_CUDA_NCCL}",
      ddp_field="fsdp_double_buffer"),
    K("fsdp_db_use_persist_buf_on_alloc_fail", False, "bool",
      no_op="a fallback of the NCCL double buffer's allocator (CUDA)",
      ddp_field="fsdp_db_use_persist_buf_on_alloc_fail"),
    K("disable_symmetric_registration", False, "bool", no_op="NCCL window registration (CUDA)",
      ddp_field="disable_symmetric_registration"),
    K("enable_fine_grained_param_gather", False, "bool",
      no_op="per-sub-module gathers for MXFP8 recompute (CUDA); a unit is gathered whole, values are the same",
      ddp_field="megatron_fsdp_enable_fine_grained_param_gather"),
    K("use_decoupled_grad", False, "bool",
      "False; True is refused (only TransformerEngine's FusedAdam reads decoupled_grad)",
      ddp_field="megatron_fsdp_use_decoupled_grad"),
    K("cuda_graph_mode", False, "bool",
      no_op="CUDA graph capture (CUDA); the .grad views stay the same tensors across steps anyway, as graph "
            "replay needs", ddp_field="megatron_fsdp_cuda_graph_mode"),
    K("maxpool_double_buffer", False, "bool", no_op="the NCCL double buffer's pool sizing (CUDA)",
      ddp_field="megatron_fsdp_max_pool_double_buffer"),
)
"""megatron_fsdp.fully_shard_model's parameters after ``module`` (0.6.1 and
Megatron-LM main), in its positional order; ``fully_shard`` takes
``optimizer`` between. Both doors take them in this order too."""

MEGATRON_LM_ALIASES: tuple[Keyword, ...] = (
    K("keep_fp8_transpose_cache_when_using_custom_fsdp", False, "bool",
      no_op="Megatron-LM's name of keep_fp8_transpose_cache"),
)
"""Accepted through ``**kwargs`` (in no signature of megatron_fsdp's)."""

FSDP2: tuple[Keyword, ...] = (
    K("mesh", None, "DeviceMesh | None", "the mesh: 1-D (shard) or 2-D (replicate, shard) as FSDP2 takes it"),
    K("shard_placement_fn", None, "Callable | None", "each parameter's chunked dimension (per-module form only)"),
    K("offload_policy", None, "OffloadPolicy | None", "CPUOffloadPolicy: main weights and grads in host memory"),
    K("ignored_params", None, "set[nn.Parameter] | None", "parameters left as they are"),
    K("mp_policy", None, "MixedPrecisionPolicy | None", "the policy (flatfsdp's or torch's)"),
    K("dp_mesh_dims", None, "Any", "mesh is the whole SPMD mesh; these name its data-parallel dimensions "
                                   "(front/spmd_mesh)"),
)
"""FSDP2's keywords (keyword-only there too); only ``fully_shard`` takes them."""

OWN: tuple[Keyword, ...] = (
    K("reshard_after_forward", None, "bool | int | None",
      "release a unit's weights after its forward; FSDP2's int in the per-module form (fsdp2_args)"),
    K("grad_reduce_in_fp32", False, "bool", "reduce gradients in fp32 (layout/precision)"),
    K("preserve_fp32_weights", True, "bool", "keep fp32 main weights (layout/precision)"),
    K("prefetch_bytes", None, "int | None", "how far gathers run ahead (runtime/root_context)"),
    K("bucket_bytes", None, "int | None", "coalesce collectives under this size (0: never)"),
    K("meta_init_seed", None, "int | None", "the seed of meta-device initialisation"),
    K("shard_block", None, "int | tuple[int, int] | None", "keep rank boundaries out of blocks (docs/placements.md)"),
    K("param_gather_dtype", None, "Any", "gather weights as block-scaled codes (docs/lowbit.md)"),
    K("grad_reduce_dtype", None, "Any", "reduce gradients in this format (docs/lowbit.md)"),
    K("lowbit_block", None, "int | None", "elements sharing one scale (docs/lowbit.md)"),
)
"""flatfsdp's own keywords (keyword-only), taken by both doors."""
del K

EVERY: tuple[Keyword, ...] = MEGATRON + MEGATRON_LM_ALIASES + FSDP2 + OWN


def _as_megatron(name: str, **changed: Any) -> Keyword:
    """The front-door keyword ``name`` (with ``changed`` fields, e.g. another default)."""
    return dataclasses.replace(next(k for k in MEGATRON if k.name == name), **changed)


_FINE_GRAINED = "per-sub-module gathers (MXFP8 recompute, MoE overlap; CUDA): a unit is gathered whole, values the same"
MEGATRON_FSDP_CLASS: tuple[Keyword, ...] = (
    Keyword("dist_index", None, "FSDPDistributedIndex | None",
            "the meshes and groups: its device_mesh, dp_shard_dim, dp_outer_dim, tp_dim, groups and expert mesh "
            "become the keywords of those names (None: one dimension over every rank)"),
    Keyword("ddp_config", None, "DistributedDataParallelConfig | None",
            "every field read by name (flatfsdp.megatron_fsdp.config_fields; None: full sharding and the switches "
            "below)"),
    _as_megatron("mixed_precision_policy"), _as_megatron("fsdp_unit_modules"), _as_megatron("disable_bucketing"),
    _as_megatron("device"), _as_megatron("calculate_per_token_loss"), _as_megatron("init_model_with_meta_device"),
    _as_megatron("sync_model_each_microbatch", default=False), _as_megatron("keep_fp8_transpose_cache"),
    _as_megatron("nccl_ub"), _as_megatron("fsdp_double_buffer"), _as_megatron("fsdp_db_use_persist_buf_on_alloc_fail"),
    _as_megatron("disable_symmetric_registration"),
    Keyword("enable_fine_grained_param_gather_hook", False, "bool", no_op=_FINE_GRAINED),
    Keyword("enable_fine_grained_param_gather_backward_hook", False, "bool", no_op=_FINE_GRAINED + " (backward)"),
    Keyword("fine_grained_recurse_module_types", None, "tuple[type, ...] | None",
            no_op="the sub-module types the fine-grained gathers recurse into"),
    _as_megatron("report_nan_in_param_grad"),
)
"""megatron_fsdp.MegatronFSDP's constructor parameters after ``module``, in its
order (flatfsdp.megatron_fsdp's class takes them): a front-door keyword of the
same name is that keyword (the class's own default where it differs); the
rest are the class's own."""

GivenKeywords = dataclasses.make_dataclass(
    "GivenKeywords", [(k.name, Any, dataclasses.field(default=k.default)) for k in EVERY], frozen=True)
GivenKeywords.__module__ = __name__
GivenKeywords.__doc__ = """The keywords of one front-door call, defaults filled in: one field per
keyword of the tables above, so ``given.misspelt`` raises instead of reading None."""


@dataclasses.dataclass(frozen=True)
class Door:
    """One front door's signature, made from the tables: ``leading`` (the
    door's own first parameters, e.g. ``module``, ``optimizer=None``), then
    ``positional`` keywords in order, then ``keyword_only`` ones, then
    ``**kwargs`` for Megatron-LM's aliases."""

    name: str
    leading: tuple[inspect.Parameter, ...]
    positional: tuple[Keyword, ...]
    keyword_only: tuple[Keyword, ...]
    aliases: bool = True
    """``**kwargs`` for Megatron-LM's aliases (megatron_fsdp's own signatures have none)."""

    @functools.cached_property
    def signature(self) -> inspect.Signature:
        return inspect.Signature([*self.leading, *self._tail.parameters.values()])

    @functools.cached_property
    def _tail(self) -> inspect.Signature:
        def param(k: Keyword, kind) -> inspect.Parameter:
            return inspect.Parameter(k.name, kind, default=k.default, annotation=k.annotation)

        return inspect.Signature(
            [param(k, inspect.Parameter.POSITIONAL_OR_KEYWORD) for k in self.positional]
            + [param(k, inspect.Parameter.KEYWORD_ONLY) for k in self.keyword_only]
            + [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD, annotation="Any")] * self.aliases)

    def takes(self, fn: Callable) -> Callable:
        """Decorate the door ``def door(<leading>, *args, **kwargs)``: it shows this signature."""
        fn.__signature__ = self.signature
        return fn

    def read(self, args: tuple, kwargs: dict[str, Any]) -> GivenKeywords:
        """The call's keywords after ``leading``, bound as the signature binds
        them (too many positional arguments, one given twice, or a name that
        is no keyword of this door: TypeError)."""
        try:
            bound = self._tail.bind(*args, **kwargs)
        except TypeError as err:
            raise TypeError(f"{self.name}(): {err}") from None
        values = dict(bound.arguments)
        extra = values.pop("kwargs", {})
        unknown = sorted(set(extra) - {k.name for k in MEGATRON_LM_ALIASES})
        if unknown:
            raise TypeError(f"{self.name}() got unexpected keyword argument(s) {unknown}")
        return GivenKeywords(**values, **extra)

    @functools.cached_property
    def _record_type(self) -> type:
        record = dataclasses.make_dataclass(f"{self.name}Keywords", [k.name for k in self.positional + self.keyword_only],
                                            frozen=True)
        record.__module__ = __name__
        return record

    def record(self, args: tuple, kwargs: dict[str, Any]):
        """The call's keywords after ``leading`` as a frozen record of this
        door's keywords only (defaults filled in; a name that is none of them:
        AttributeError) -- for a door whose keywords are not all the front
        doors' (``MEGATRON_FSDP_CLASS``). Binding errors as ``read``'s."""
        try:
            bound = self._tail.bind(*args, **kwargs)
        except TypeError as err:
            raise TypeError(f"{self.name}(): {err}") from None
        bound.apply_defaults()
        if bound.arguments.pop("kwargs", None):
            raise TypeError(f"{self.name}() takes no Megatron-LM aliases here")
        return self._record_type(**bound.arguments)
