"""What a strategy cannot do with less of, per rank per step, from the parameter count alone.

P is the number of unique parameters (unpadded), W the world size, ``w`` the
bytes of one weight in the compute dtype, ``g`` of one gradient in the reduce
dtype. Volumes are in the unit of the communication accounts: bytes of the full
buffer a collective covers.

| ZeRO stage | all-gather | gradient reduction |
|---|---|---|
| 0 (no_shard, DDP) | -- | all-reduce P*g |
| 1, 2 (optim, optim_grads) | P*w (updated weights after the step) | reduce-scatter P*g |
| 3 (optim_grads_params) | 2*P*w (forward, and again for backward) | reduce-scatter P*g |

An engine may come in under the ZeRO-3 line by keeping some units gathered
from their forward to their backward (FSDP2 keeps the root; flatfsdp the root
and the last block): that trades memory for bytes and shows as a ratio below 1.
Gathering the same bytes in the compute dtype is the floor for the weights;
reducing in the reduce dtype the floor for the gradients.
"""

from __future__ import annotations

STRATEGY_STAGE = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}


def min_comm_bytes(stage: int | None, n_params: int, weight_bytes: int, grad_bytes: int) -> dict[str, int]:
    """Minimum bytes per step per rank by collective kind; {} for no communication."""
    if stage is None:
        return {}
    if stage == 0:
        return {"all_reduce": n_params * grad_bytes}
    gathers = 2 if stage == 3 else 1
    return {"all_gather": gathers * n_params * weight_bytes, "reduce_scatter": n_params * grad_bytes}


def min_state_bytes(stage: int | None, n_params: int, world: int, bf16: bool) -> float:
    """Bytes of model state a rank must keep between steps (activations excluded).

    fp32: weights 4, gradients 4, AdamW moments 8 bytes per parameter; the fp32
    weights double as the optimizer's main weights. bf16: bf16 model weights 2
    plus fp32 main weights 4, fp32 gradients 4 and moments 8. ``stage`` None is
    an unsharded replica (the compute floor), the same as stage 0.
    """
    P, W = n_params, world
    model_w = 2 * P if bf16 else 0          # the bf16 compute copy, if separate
    main_w, grads, moments = 4 * P, 4 * P, 8 * P
    stage = stage or 0
    if stage == 0:
        return model_w + main_w + grads + moments
    if stage == 1:
        return model_w + (main_w if not bf16 else main_w / W) + grads + moments / W
    if stage == 2:
        return model_w + (main_w if not bf16 else main_w / W) + (grads + moments) / W
    return (model_w + main_w + grads + moments) / W
