"""Mixed precision: which dtype computes, which dtype the optimizer keeps, which dtype reduces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


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

    def grad_reduce_dtype(self, original: torch.dtype) -> torch.dtype:
        return self.reduce_dtype or self.compute_dtype(original)


def resolve_policy(policy: Any, *, grad_reduce_in_fp32: bool = False,
                   preserve_fp32_weights: bool = True) -> MixedPrecisionPolicy:
    """Accept ours, torch's ``torch.distributed.fsdp.MixedPrecisionPolicy`` or None.

    Megatron-FSDP's flags ``grad_reduce_in_fp32`` and ``preserve_fp32_weights``
    refine a policy that does not say otherwise.
    """
    if policy is None:
        policy = MixedPrecisionPolicy()
    elif not isinstance(policy, MixedPrecisionPolicy):
        fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
        if not all(hasattr(policy, f) for f in fields):
            raise TypeError(f"mixed precision policy of type {type(policy).__name__} is not understood: "
                            "pass flatfsdp.MixedPrecisionPolicy or torch.distributed.fsdp.MixedPrecisionPolicy")
        policy = MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,
                                      output_dtype=policy.output_dtype,
                                      cast_forward_inputs=policy.cast_forward_inputs,
                                      # torch 2.15 added it; older policies have none
                                      param_dtype_override_fn=getattr(policy, "param_dtype_override_fn", None))
    if grad_reduce_in_fp32 and policy.reduce_dtype is None:
        policy = _replace(policy, reduce_dtype=torch.float32)
    if not preserve_fp32_weights:
        policy = _replace(policy, main_params_dtype=None)
    return policy


def _replace(policy: MixedPrecisionPolicy, **changes: Any) -> MixedPrecisionPolicy:
    from dataclasses import replace
    return replace(policy, **changes)
