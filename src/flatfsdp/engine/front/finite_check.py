"""Is this step's loss or gradient NaN/inf? Asked cheaply on every step.

A non-finite value anywhere spreads to every weight at the next optimizer
step (AdamW's moments turn NaN), silently. The check is split so it costs no
round trip of its own:

* ``local_nonfinite(model, loss)`` -- no communication: one sum per param
  group over this rank's shard of the reduced gradients (plus the loss), as
  one 0-dim float (1.0: something here is not finite). Fold it into an
  all-reduce the loop makes anyway (the loss); a sum > 0 means some rank saw one.
* ``nonfinite_report(model, loss)`` -- only once that happened: collective,
  names the first parameters whose gradients are not finite and the ranks
  whose loss is not.
* ``check_finite(model, loss)`` -- both, for loops that have no all-reduce of
  their own to fold the flag into: one all-reduce of one number.

A sum is NaN or inf exactly when an element is (or when finite values
overflow it, which for gradients is divergence anyway), so the fast path
reads each shard once and allocates nothing of its size. Call it after
gradients are reduced (``finish_grad_sync()`` or the end of backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from flatfsdp.engine.runtime.nonfinite_flag import MAX_NAMES, NonFiniteError, NonFiniteReport, resolve_mode
from flatfsdp.engine.runtime.unit_state import unit_states

__all__ = ["NonFiniteError", "NonFiniteReport", "check_finite", "local_nonfinite", "nonfinite_report",
           "set_on_nonfinite"]

def set_on_nonfinite(model: nn.Module, mode: str) -> None:
    """What the engine does when a step's reduced gradients hold NaN/inf
    (noticed at the next forward's start, with no host sync of its own; Note
    [the non-finite flag] in runtime/nonfinite_flag.py): "warn" (the default,
    or FLATFSDP_ON_NONFINITE), "error" (NonFiniteError on every rank, before
    the next forward; one tiny all-reduce per step) or "off"."""
    resolve_mode(mode)
    states = unit_states(model)
    if not states:
        raise ValueError(f"set_on_nonfinite: {type(model).__name__} has no sharded unit (call fully_shard first)")
    for state in states:
        state.controls.on_nonfinite = mode


def _local_grads(model: nn.Module) -> list[torch.Tensor]:
    """This rank's gradient data: each param group's reduced main grads (one
    flat shard), plus the grads of any parameter no unit manages."""
    tensors, managed = [], set()
    for state in unit_states(model):
        for group in state.groups:
            managed.update(id(p) for p in group.sharded_params)
            if group.trainable and any(p.grad is not None for p in group.sharded_params):
                tensors.append(group.main_grads())
    for p in model.parameters():
        if id(p) not in managed and p.grad is not None:
            tensors.append(_local(p.grad))
    return tensors


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_nonfinite(model: nn.Module, loss: torch.Tensor | None = None) -> torch.Tensor:
    """0-dim float32 tensor on the gradients' device: 1.0 if this rank's loss or
    its share of the gradients holds NaN/inf, else 0.0. No communication."""
    for state in unit_states(model):  # reductions left in flight (sync_model_each_microbatch=False) land first
        for group in state.groups:
            group.complete_reduction()
    values = [t.sum().float() for t in _local_grads(model)]
    if loss is not None:
        values.append(loss.detach().sum().float().to(values[0].device if values else loss.device))
    if not values:
        return torch.zeros((), dtype=torch.float32)
    # Sums of main grads in host memory are on the host, others' on the device: one device for the stack.
    total = torch.stack([v.to(values[0].device) for v in values]).sum()
    return (~torch.isfinite(total)).float()


def nonfinite_report(model: nn.Module, loss: torch.Tensor | None = None,
                     group: dist.ProcessGroup | None = None) -> NonFiniteReport:
    """What is not finite, and where (collective over ``group``, default the world).
    Slow path: reads every gradient; run it only once the flag said so."""
    group = group or dist.group.WORLD
    bad = [i for i, (_, p) in enumerate(model.named_parameters())
           if p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all())]
    loss_bad = loss is not None and not bool(torch.isfinite(loss.detach()).all())
    everyone: list = [None] * group.size()
    dist.all_gather_object(everyone, (dist.get_rank(), loss_bad, bad), group=group)
    names = [n for n, _ in model.named_parameters()]
    indices = sorted({i for _, _, found in everyone for i in found})
    return NonFiniteReport(loss_ranks=tuple(rank for rank, flagged, _ in everyone if flagged),
                           params=tuple(names[i] for i in indices[:MAX_NAMES]), param_count=len(indices))


def check_finite(model: nn.Module, loss: torch.Tensor | None = None, *, step: int | None = None,
                 group: dist.ProcessGroup | None = None) -> None:
    """Raise NonFiniteError on every rank if any rank's loss or gradients hold
    NaN/inf (call it between backward and ``optimizer.step()``; skip the step or
    stop when it raises). One all-reduce of one number when all is well."""
    group = group or dist.group.WORLD
    flag = local_nonfinite(model, loss)
    if dist.get_backend(group) != "gloo" and flag.device.type == "cpu":
        flag = flag.to(torch.accelerator.current_accelerator())
    dist.all_reduce(flag, group=group)
    if flag.item() > 0:
        raise NonFiniteError(nonfinite_report(model, loss, group), step)
