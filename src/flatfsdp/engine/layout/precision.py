"""Mixed precision: which dtype computes, which dtype the optimizer keeps, which dtype reduces."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from flatfsdp.engine.layout.block_formats import BlockFormat, parse_format


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    param_dtype: torch.dtype | None = None
    """Dtype the forward and backward compute in (e.g. bf16). None: the parameter's own dtype."""
    reduce_dtype: torch.dtype | None = None
    """Dtype gradients are communicated (and accumulated unsharded) in. None: ``param_dtype``."""
    main_params_dtype: torch.dtype | None = torch.float32
    """Dtype of the sharded main weights, gradients and optimizer state. None: the parameter's own dtype."""
    output_dtype: torch.dtype | None = None
    """Cast floating-point forward outputs of a unit to this dtype. None: leave them."""
    cast_forward_inputs: bool = True
    """Cast floating-point forward inputs of a unit to ``param_dtype``."""
    param_dtype_override_fn: Callable[[Any], torch.dtype | None] | None = field(default=None, kw_only=True)
    """FSDP2's (torch 2.15): called once per parameter at ``fully_shard``;
    returning the parameter's own dtype keeps it in that dtype (e.g. norms
    in fp32 under bf16), None or ``param_dtype`` keeps the default. Must
    answer the same on every rank. Inputs are still cast to ``param_dtype``."""

    param_gather_dtype: Any = field(default=None, kw_only=True)
    """Gather weights as block-scaled 8-bit codes: a format of
    layout/block_formats.py ("int8", "fp8" = e4m3, "e5m2") or its torch
    dtype; dequantized into ``param_dtype`` where the module reads them.
    None: gathered in ``param_dtype``. See docs/lowbit.md."""
    grad_reduce_dtype: Any = field(default=None, kw_only=True)
    """Reduce gradients as block-scaled codes ("int8", "fp8", "e5m2"; summed
    in fp32), or in a float dtype ("bf16" = ``reduce_dtype=torch.bfloat16``).
    None: ``reduce_dtype``."""
    lowbit_block: int | None = field(default=None, kw_only=True)
    """Elements per scale of the 8-bit codes (None: block_formats.DEFAULT_BLOCK)."""
    main_grads_dtype: torch.dtype | None = field(default=None, kw_only=True)
    """Megatron-FSDP's: dtype of the sharded main grads, and of the reduction
    unless ``reduce_dtype`` says otherwise. None: the main weights' dtype
    (and the reduction in ``param_dtype``). Narrower than the main weights,
    the optimizer reads a copy cast to theirs, made once per reduction."""
    grad_comm_dtype: torch.dtype | None = field(default=None, kw_only=True)
    """Megatron-FSDP's name for ``reduce_dtype`` (give one or the other)."""

    def __post_init__(self) -> None:
        if self.grad_comm_dtype is not None:
            if self.reduce_dtype is not None and self.reduce_dtype != self.grad_comm_dtype:
                raise ValueError(f"grad_comm_dtype={self.grad_comm_dtype} and reduce_dtype={self.reduce_dtype} "
                                 "name the same thing (the dtype gradients are reduced in): give one")
            object.__setattr__(self, "reduce_dtype", self.grad_comm_dtype)
        self.gather_format  # validated at construction, named by its keyword
        self.reduce_format

    @property
    def gather_format(self) -> BlockFormat | None:
        return parse_format(self.param_gather_dtype, self.lowbit_block)

    @property
    def reduce_format(self) -> BlockFormat | None:
        """The low-bit format gradients travel in (None: ``reduce_dtype``)."""
        if _float_dtype(self.grad_reduce_dtype) is not None or self.grad_reduce_dtype is None:
            return None
        return parse_format(self.grad_reduce_dtype, self.lowbit_block, what="grad_reduce_dtype")

    def keeps_original_dtype(self, param: Any, name: str) -> bool:
        """Whether ``param_dtype_override_fn`` keeps ``param`` (named ``name``) in its own dtype."""
        if self.param_dtype_override_fn is None:
            return False
        chosen = self.param_dtype_override_fn(param)
        if chosen is None or chosen == self.param_dtype:
            return False
        if not isinstance(chosen, torch.dtype):
            raise ValueError(f"param_dtype_override_fn must return a torch.dtype or None, got "
                             f"{type(chosen).__name__} for parameter '{name}'")
        if chosen != param.dtype:
            raise ValueError(f"param_dtype_override_fn must return None, param_dtype ({self.param_dtype}) or the "
                             f"parameter's own dtype; got {chosen} for parameter '{name}' of dtype {param.dtype}")
        return True

    def for_original_dtype(self) -> "MixedPrecisionPolicy":
        """This policy for a parameter kept in its own dtype."""
        return _replace(self, param_dtype=None, param_dtype_override_fn=None)

    def compute_dtype(self, original: torch.dtype) -> torch.dtype:
        if not original.is_floating_point:
            return original
        return self.param_dtype or original

    def main_dtype(self, original: torch.dtype) -> torch.dtype:
        """Never narrower than the parameter: fp64 parameters keep fp64 main
        weights (and are stepped in fp64), as FSDP2 does; fp32 main weights are
        a floor for low-precision parameters, not a cap."""
        if not original.is_floating_point:
            return original
        main = self.main_params_dtype or original
        return original if original.itemsize > main.itemsize else main

    def reduction_dtype(self, original: torch.dtype) -> torch.dtype:
        """Gradients accumulate (and, unless low-bit, travel) in this dtype;
        low-bit reductions accumulate in fp32."""
        if self.reduce_format is not None:
            return torch.float32 if original.is_floating_point else original
        if not original.is_floating_point:
            return original
        return (_float_dtype(self.grad_reduce_dtype) or self.reduce_dtype or self.main_grads_dtype
                or self.compute_dtype(original))

    def grads_dtype(self, original: torch.dtype) -> torch.dtype:
        """The sharded main grads' dtype (``main_grads_dtype``, else the main weights')."""
        if not original.is_floating_point or self.main_grads_dtype is None:
            return self.main_dtype(original)
        return self.main_grads_dtype


def resolve_policy(policy: Any, *, grad_reduce_in_fp32: bool = False,
                   preserve_fp32_weights: bool = True, wire: dict | None = None) -> MixedPrecisionPolicy:
    """Accept ours, torch's ``torch.distributed.fsdp.MixedPrecisionPolicy``,
    Megatron-FSDP's ``megatron_fsdp.MixedPrecisionPolicy`` (megatron_policy) or None.

    Megatron-FSDP's flags ``grad_reduce_in_fp32`` and ``preserve_fp32_weights``
    refine a policy that does not say otherwise; so do ``fully_shard``'s
    ``param_gather_dtype`` / ``grad_reduce_dtype`` / ``lowbit_block`` (``wire``).
    """
    if policy is None:
        policy = MixedPrecisionPolicy()
    elif is_megatron_policy(policy):
        policy = from_megatron_policy(policy)
    elif not isinstance(policy, MixedPrecisionPolicy):
        fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
        if not all(hasattr(policy, f) for f in fields):
            raise TypeError(f"mixed precision policy of type {type(policy).__name__} is not understood: "
                            "pass flatfsdp.MixedPrecisionPolicy, torch.distributed.fsdp.MixedPrecisionPolicy "
                            "or megatron_fsdp.MixedPrecisionPolicy")
        policy = MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,
                                      output_dtype=policy.output_dtype,
                                      cast_forward_inputs=policy.cast_forward_inputs,
                                      # torch 2.15 added it; older policies have none
                                      param_dtype_override_fn=getattr(policy, "param_dtype_override_fn", None))
    given = {k: v for k, v in (wire or {}).items() if v is not None}
    for key, value in given.items():
        if getattr(policy, key) is not None and getattr(policy, key) != value:
            raise ValueError(f"{key}={value!r} given both to fully_shard and in the mixed precision policy "
                             f"({getattr(policy, key)!r})")
    if given:
        policy = _replace(policy, **given)
    if grad_reduce_in_fp32 and policy.reduce_dtype is None:
        policy = _replace(policy, reduce_dtype=torch.float32)
    if not preserve_fp32_weights:
        policy = _replace(policy, main_params_dtype=None)
    return policy


MEGATRON_FIELDS = ("main_params_dtype", "main_grads_dtype", "grad_comm_dtype")
"""megatron_fsdp.MixedPrecisionPolicy's fields (0.6.1), read by name: the
engine never imports megatron_fsdp."""


def is_megatron_policy(policy: Any) -> bool:
    """Megatron-FSDP's policy: it names main grads or a gradient
    communication dtype, and no compute dtype (``param_dtype``)."""
    return (not isinstance(policy, MixedPrecisionPolicy) and not hasattr(policy, "param_dtype")
            and any(hasattr(policy, f) for f in MEGATRON_FIELDS[1:]))


def from_megatron_policy(policy: Any) -> MixedPrecisionPolicy:
    """Megatron-FSDP's policy, field by field: ``main_params_dtype`` is ours;
    ``main_grads_dtype`` the sharded main grads' dtype and, without
    ``grad_comm_dtype``, the reduction's; ``grad_comm_dtype`` the reduction's.
    Megatron-FSDP computes in the parameters' own dtype, as ``param_dtype=None``
    does. A field this reading does not know is refused by name, unless unset."""
    if dataclasses.is_dataclass(policy):
        unknown = [f.name for f in dataclasses.fields(policy)
                   if f.name not in MEGATRON_FIELDS and getattr(policy, f.name) is not None]
        if unknown:
            raise TypeError(f"megatron_fsdp.MixedPrecisionPolicy field(s) {unknown} are not understood by flatfsdp "
                            f"(it reads {list(MEGATRON_FIELDS)}); leave them unset")
    values = {f: getattr(policy, f, None) for f in MEGATRON_FIELDS}
    for name, value in values.items():
        if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
            raise TypeError(f"megatron_fsdp.MixedPrecisionPolicy.{name} must be a floating torch.dtype or None, "
                            f"got {value!r}")
    return MixedPrecisionPolicy(**values)


_FLOAT_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
                "fp32": torch.float32, "float32": torch.float32}


def _float_dtype(value) -> torch.dtype | None:
    if isinstance(value, torch.dtype) and value.is_floating_point and value.itemsize >= 2:
        return value
    return _FLOAT_NAMES.get(value) if isinstance(value, str) else None


def _replace(policy: MixedPrecisionPolicy, **changes: Any) -> MixedPrecisionPolicy:
    from dataclasses import replace
    return replace(policy, **changes)
