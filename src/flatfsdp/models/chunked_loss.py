"""Cross-entropy of the output projection without the micro-batch's logits.

``F.cross_entropy(hidden @ W.T)`` holds several tensors of tokens x vocab at
once: the logits, their fp32 copy, the log-softmax saved for backward, and in
backward the gradient of each -- with a 32k vocabulary and 1024 tokens, 131 MB
apiece, more than the rest of a small model's activations together.

Here the tokens go through the projection a chunk at a time. Each chunk's
logits are made, turned into the chunk's loss *and* its gradient with respect
to the logits (softmax minus one-hot: the loss is a sum, so that gradient is
known in forward), pushed through the projection's two matmuls (into the
hidden states' gradient and the weight's), and dropped. Backward then only
scales the stored gradients by the incoming one. The matmul work is that of
the unchunked forward + backward -- nothing is recomputed -- and the largest
transient is one chunk's logits. The loss is computed in fp32 whatever the
compute dtype, as ``lm_loss`` does.
"""

from __future__ import annotations

import torch

CHUNK_BYTES = 16 << 20
"""fp32 logits per chunk: 128 tokens of a 32k vocabulary."""
IGNORE_INDEX = -100
"""Targets equal to this add nothing (transformers' convention)."""


def default_chunk_tokens(vocab_size: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab_size))


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens: int):
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if want_bias else None
        for start in range(0, hidden.shape[0], chunk_tokens):
            h = hidden[start:start + chunk_tokens]
            t = targets[start:start + chunk_tokens]
            logits = torch.nn.functional.linear(h, weight, bias).float()
            valid = t != IGNORE_INDEX
            safe = torch.where(valid, t, 0)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[:, None]).squeeze(1)
            total += torch.where(valid, lse - picked, 0.0).sum()
            if not (want_hidden or want_weight or want_bias):
                continue
            grad = logits.sub_(lse[:, None]).exp_()  # softmax, in the logits' storage
            grad[torch.arange(grad.shape[0], device=grad.device), safe] -= 1.0
            grad.mul_(valid[:, None])
            if want_bias:
                grad_bias += grad.sum(0)
            grad = grad.to(h.dtype)
            if want_hidden:
                torch.matmul(grad, weight, out=grad_hidden[start:start + chunk_tokens])
            if want_weight and grad_weight.dtype == h.dtype:
                grad_weight.addmm_(grad.t(), h)  # in place: no vocab x width temporary per chunk
            elif want_weight:
                grad_weight += (grad.t() @ h).float()
        ctx.save_for_backward(*(g for g in (grad_hidden, grad_weight, grad_bias) if g is not None))
        ctx.wanted = (want_hidden, want_weight, want_bias)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        saved = iter(ctx.saved_tensors)
        grads = [next(saved) if wanted else None for wanted in ctx.wanted]
        if grads[0] is not None:
            grads[0] = grads[0] * grad_total.to(grads[0].dtype)
        if grads[1] is not None:
            grads[1] = (grads[1] * grad_total).to(ctx.dtypes[0])
        if grads[2] is not None:
            grads[2] = (grads[2] * grad_total).to(ctx.dtypes[1])
        return grads[0], grads[1], grads[2], None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          bias: torch.Tensor | None = None, reduction: str = "mean",
                          chunk_tokens: int | None = None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), targets)`` over
    the last dim of ``hidden`` ``[..., d]`` and ``targets`` ``[...]``, computed a
    chunk of tokens at a time (same value; gradients equal to rounding).
    ``reduction``: "sum" or "mean" (over targets not equal to IGNORE_INDEX)."""
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    if flat_hidden.shape[0] != flat_targets.shape[0]:
        raise ValueError(f"{flat_hidden.shape[0]} hidden states but {flat_targets.shape[0]} targets")
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    total = _ChunkedCrossEntropy.apply(flat_hidden, weight, bias, flat_targets, chunk)
    if reduction == "sum":
        return total
    return total / (flat_targets != IGNORE_INDEX).sum().clamp(min=1)
