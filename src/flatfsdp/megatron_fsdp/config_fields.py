"""How ``MegatronFSDP`` reads a ``DistributedDataParallelConfig``: one table,
field by field.

The config may be this package's class or Megatron-Core's (``megatron.core.
distributed.DistributedDataParallelConfig``, a superset that Megatron-Core's
adapter passes). Each field is either passed on as a keyword of
``flatfsdp.fully_shard_model`` (``keyword``), read elsewhere (the policy's
dtypes), or changes nothing here -- each with the reason. A field flatfsdp
cannot honour is refused when set to anything but its default
(``refused_unless``). A field the table does not name is refused by name: a
newer config's new switch is never silently dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flatfsdp.engine import MEGATRON_KEYWORDS
from flatfsdp.megatron_fsdp.mixed_precision import MixedPrecisionPolicy

_ANY = object()


@dataclasses.dataclass(frozen=True)
class Field:
    note: str
    """How the field is read, or why it changes nothing."""
    keyword: str | None = None
    """The ``fully_shard_model`` keyword it becomes (None: not passed on)."""
    refused_unless: Any = _ANY
    """A value other than this one is refused (flatfsdp cannot honour it)."""


def _passed(keyword: str, note: str) -> Field:
    return Field(note, keyword)


def _refused(default: Any, note: str) -> Field:
    return Field(note, None, default)


_READ_HERE: dict[str, Field] = {
    # -- read: they decide what flatfsdp shards and how --
    "data_parallel_sharding_strategy": _passed("zero_dp_strategy", "ZeRO-0..3: no_shard, optim, optim_grads, "
                                               "optim_grads_params"),
    "outer_dp_sharding_strategy": _passed("outer_dp_sharding_strategy", "across dp_outer_dim: no_shard (HSDP) or "
                                          "optim (HFSDP)"),
    "megatron_fsdp_main_params_dtype": Field("the policy's main_params_dtype when no mixed_precision_policy is "
                                             "passed (Megatron-Core's adapter passes one built from these three)"),
    "megatron_fsdp_main_grads_dtype": Field("the policy's main_grads_dtype, as above"),
    "megatron_fsdp_grad_comm_dtype": Field("the policy's grad_comm_dtype, as above"),
    # -- not read: what they configure does not exist in flatfsdp, or is decided elsewhere --
    "bucket_size": Field("Megatron-FSDP's bucket is an FSDP unit; flatfsdp coalesces small collectives up to its "
                         "own bucket size (the disable_bucketing argument turns that off)"),
    "gradient_reduce_div_fusion": Field("a CUDA fusion of the 1/N division; flatfsdp divides once after the sum"),
    "suggested_communication_unit_size": Field("sizes Megatron-FSDP's automatic units when fsdp_unit_modules is "
                                               "empty; flatfsdp makes the root one unit and coalesces by size"),
    "fsdp_all_gather_in_start_param_sync": Field("gathers start with the next forward, the next unit prefetched"),
    "fsdp_manual_registration": Field("NCCL user-buffer registration; param_and_grad_buffer."
                                      "manual_buffer_registration() is a no-op here"),
    # -- Megatron-Core's config only --
    "use_megatron_fsdp": Field("says which wrapper Megatron-Core builds: this one"),
    "use_custom_fsdp": Field("Megatron-Core's older name of use_megatron_fsdp"),
    "use_distributed_optimizer": Field("Megatron-Core's optimizer choice; data_parallel_sharding_strategy says "
                                       "what is sharded"),
    "grad_reduce_in_fp32": Field("Megatron-Core's own DDP buffers; Megatron-FSDP's gradient dtypes come from the "
                                 "megatron_fsdp_*_dtype fields (the policy), in stock Megatron-FSDP too"),
    "num_distributed_optimizer_instances": Field("read by Megatron-Core's adapter: above 1 it gives dist_index an "
                                                 "outer (HSDP) dimension, which flatfsdp reads there"),
    "align_param_gather": Field("bucket order of Megatron-Core's own DDP; Megatron-FSDP does not read it"),
    "num_buckets": Field("bucket count of Megatron-Core's own DDP; Megatron-FSDP does not read it"),
    "pad_buckets_for_high_nccl_busbw": Field("bucket padding of Megatron-Core's own DDP (NCCL)"),
    "check_for_large_grads": _refused(False, "a check of Megatron-Core's own DDP that Megatron-FSDP does not make"),
    "reduce_scatter_with_fp32_accumulation": _refused(False, "flatfsdp reduces in the policy's grad_comm_dtype; "
                                                      "set megatron_fsdp_grad_comm_dtype=torch.float32 instead"),
    "param_name_patterns_for_fp32_local_accumulation": _refused((), "per-parameter fp32 accumulation of "
                                                                "Megatron-Core's own DDP"),
    "fp8_param_gather": _refused(False, "TransformerEngine FP8 weights (CUDA); flatfsdp gathers 8-bit codes only "
                                 "as flatfsdp.fully_shard(param_gather_dtype='fp8')"),
    "fp4_param_gather": _refused(False, "TransformerEngine FP4 weights (CUDA)"),
    "reuse_grad_buf_for_mxfp8_param_ag": _refused(False, "TransformerEngine MXFP8 weights (CUDA)"),
    "delay_wgrad_compute": _refused(False, "TransformerEngine's delayed weight-gradient hook (CUDA)"),
}

_AS_KEYWORDS: dict[str, Field] = {k.ddp_field: Field(k.reads or k.no_op, k.name)
                                  for k in MEGATRON_KEYWORDS if k.ddp_field is not None}
"""The fields a ``fully_shard_model`` keyword sets as given: taken from the
engine's keyword table (its ``ddp_field``), not written here again; the
engine says how each is read or why it changes nothing."""

FIELDS: dict[str, Field] = {**_AS_KEYWORDS, **_READ_HERE}


def keywords_from_config(config: Any) -> dict[str, Any]:
    """The ``fully_shard_model`` keywords ``config`` asks for; a field not in
    ``FIELDS``, or one set where flatfsdp cannot follow, is refused by name."""
    kind = type(config).__name__
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"ddp_config must be a DistributedDataParallelConfig (a dataclass), got {kind}")
    unknown = sorted(f.name for f in dataclasses.fields(config) if f.name not in FIELDS)
    if unknown:
        raise TypeError(f"{kind} field(s) {unknown} are not known to flatfsdp.megatron_fsdp: it reads every field "
                        "of the config, and these it cannot say it honours (config_fields.FIELDS)")
    keywords = {}
    for f in dataclasses.fields(config):
        entry, value = FIELDS[f.name], getattr(config, f.name)
        if entry.refused_unless is not _ANY and _differs(value, entry.refused_unless):
            raise NotImplementedError(f"{kind}.{f.name}={value!r}: {entry.note}; flatfsdp cannot honour it, "
                                      f"leave it {entry.refused_unless!r}")
        if entry.keyword is not None:
            keywords[entry.keyword] = value
    return keywords


def policy_from_config(config: Any) -> MixedPrecisionPolicy:
    """The policy the config's three ``megatron_fsdp_*_dtype`` fields name."""
    return MixedPrecisionPolicy(main_params_dtype=config.megatron_fsdp_main_params_dtype,
                                main_grads_dtype=config.megatron_fsdp_main_grads_dtype,
                                grad_comm_dtype=config.megatron_fsdp_grad_comm_dtype)


def _differs(value: Any, default: Any) -> bool:
    if isinstance(default, tuple):
        return tuple(value or ()) != default
    return value != default
