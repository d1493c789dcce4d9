"""DeepSpeed's published estimates of model-state memory per GPU, for the
comparison in docs/scale.md and `flatfsdp estimate --deepspeed`.

DeepSpeed ships two functions (deepspeed.runtime.zero, documented on its
"Memory Requirements" page); without offload they say:

* stages 1 and 2 (one function for both): ``4 P + 16 P / N`` bytes;
* stage 3: ``4 L + 18 P / N`` bytes, ``L`` the parameters of the largest
  single module (its own, not its children's).

``P`` counts each unique parameter once, ``N`` is the number of GPUs. These are
model states only: no activations, no communication buffers. HSDP is not one of
their cases; sharding over ``N = shard group`` (what MiCS / hpZ do) is the
natural reading and the one used here.
"""

from __future__ import annotations

from torch import nn


def model_counts(model: nn.Module) -> tuple[int, int]:
    """(unique parameters, parameters of the largest single module)."""
    unique = {id(p): p.numel() for p in model.parameters()}
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return sum(unique.values()), largest


def deepspeed_model_states(stage: int, params: int, largest_layer: int, gpus: int) -> int | None:
    """Bytes per GPU DeepSpeed's estimator gives for ZeRO ``stage``; None for
    stage 0, which it has no estimator for."""
    if stage == 0:
        return None
    if stage in (1, 2):
        return 4 * params + 16 * params // gpus
    return 4 * largest_layer + 18 * params // gpus
