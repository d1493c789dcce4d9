"""What `flatfsdp estimate --probe` times on this machine: the estimated
model's own training step, unsharded -- the forward and loss of the
estimator's step (rank_step.step), backward, clipping and AdamW; with
``bf16``, a bf16 compute copy beside fp32 main weights, as the sharded step
computes. The probe (probe.py) launches it on fresh ranks."""

from __future__ import annotations

import copy

import torch

from flatfsdp.estimator.models import resolve_model
from flatfsdp.estimator.probe import probe_device
from flatfsdp.models.gpt import lm_loss


def spec_step(model: str, micro_batch: int, seq_len: int, bf16: bool, recompute: str):
    """One training step of ``model`` (a name ``resolve_model`` knows), built for real on this rank."""
    spec = resolve_model(model, recompute=recompute)
    device = probe_device()
    main = spec.build().to_empty(device=device)
    with torch.no_grad():  # values do not change the time; small ones keep the loss finite
        for p in main.parameters():
            p.normal_(0.0, 0.02)
    compute = copy.deepcopy(main).to(torch.bfloat16) if bf16 else main
    mains, computes = list(main.parameters()), list(compute.parameters())
    optimizer = torch.optim.AdamW(mains, lr=1e-4, weight_decay=0.1, foreach=True)
    batch = torch.randint(0, spec.vocab_size, (micro_batch, seq_len + 1), device=device)

    def step() -> None:
        loss = lm_loss(spec.logits(compute, batch[:, :-1]), batch[:, 1:], reduction="sum")
        loss.backward()
        if bf16:
            for m, c in zip(mains, computes):
                m.grad, c.grad = c.grad.float(), None
        torch.nn.utils.clip_grad_norm_(mains, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if bf16:
            with torch.no_grad():
                torch._foreach_copy_(computes, mains)
    return step
