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
transient is one chunk's logits: the softmax is made in their storage.

The stored gradients are handed to autograd as they are (scaled in place, never
copied), so the vocab x width weight gradient exists once. With a tied input
embedding autograd would still sum two such tensors into a third; a
`WeightGradHandoff` (tied_embedding.py) lets the embedding's backward add its
rows into this one instead. The loss is computed in fp32 whatever the compute
dtype, as ``lm_loss`` does.
"""

from __future__ import annotations

import torch

from flatfsdp.models.tied_embedding import WeightGradHandoff

CHUNK_BYTES = 16 << 20
"""fp32 logits per chunk: 128 tokens of a 32k vocabulary."""
IGNORE_INDEX = -100
"""Targets equal to this add nothing (transformers' convention)."""


def default_chunk_tokens(vocab_size: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab_size))


def _chunk_loss_and_softmax(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The chunk's summed loss; ``logits`` (fp32, owned) becomes the softmax in place."""
    picked = logits.gather(1, targets[:, None]).squeeze(1)
    top = logits.amax(dim=-1, keepdim=True)
    probs = logits.sub_(top).exp_()
    norm = probs.sum(dim=-1, keepdim=True)
    lse = top.squeeze(1) + norm.squeeze(1).log()
    probs.div_(norm)
    return torch.where(valid, lse - picked, 0.0).sum()


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens: int, handoff: WeightGradHandoff | None):
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        want_any = want_hidden or want_weight or want_bias
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if want_bias else None
        for start in range(0, hidden.shape[0], chunk_tokens):
            h = hidden[start:start + chunk_tokens]
            t = targets[start:start + chunk_tokens]
            logits = torch.nn.functional.linear(h, weight, bias).float()  # ours: used in place
            valid = t != IGNORE_INDEX
            safe = torch.where(valid, t, 0)
            total += _chunk_loss_and_softmax(logits, safe, valid)
            if not want_any:
                continue
            grad = logits  # the softmax, now less the one-hot, zero on ignored targets
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
        # Kept on ctx, not saved for backward: backward hands them over (and
        # scales them in place), so they are consumed by one backward.
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.handoff = handoff
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if ctx.grads is None:
            raise RuntimeError("chunked_cross_entropy: a second backward through the same loss; its gradients "
                               "are computed in forward and handed over once (run the forward again rather "
                               "than retain_graph=True)")
        grad_hidden, grad_weight, grad_bias = ctx.grads
        ctx.grads = None
        if grad_hidden is not None:
            grad_hidden.mul_(grad_total.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_total).to(ctx.dtypes[0])
            if ctx.handoff is not None:  # the tied embedding's backward adds its rows and returns it
                ctx.handoff.put(grad_weight)
                grad_weight = None
        if grad_bias is not None:
            grad_bias = grad_bias.mul_(grad_total).to(ctx.dtypes[1])
        return grad_hidden, grad_weight, grad_bias, None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          bias: torch.Tensor | None = None, reduction: str = "mean",
                          chunk_tokens: int | None = None,
                          weight_grad_handoff: WeightGradHandoff | None = None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), targets)`` over
    the last dim of ``hidden`` ``[..., d]`` and ``targets`` ``[...]``, computed a
    chunk of tokens at a time (same value; gradients equal to rounding).
    ``reduction``: "sum" or "mean" (over targets not equal to IGNORE_INDEX).
    ``weight_grad_handoff``: the one given to the tied embedding lookup of the
    same forward (`embedding_with_handoff`), which then returns ``weight``'s
    whole gradient. One backward per forward (no ``retain_graph``)."""
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    if flat_hidden.shape[0] != flat_targets.shape[0]:
        raise ValueError(f"{flat_hidden.shape[0]} hidden states but {flat_targets.shape[0]} targets")
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    total = _ChunkedCrossEntropy.apply(flat_hidden, weight, bias, flat_targets, chunk, weight_grad_handoff)
    if reduction == "sum":
        return total
    return total / (flat_targets != IGNORE_INDEX).sum().clamp(min=1)
