"""An embedding lookup that shares its weight's gradient buffer with the
chunked loss of the same forward (tied input and output embeddings).

When one parameter is both the embedding and the output projection, autograd
gets two vocab x width gradients for it and sums them out of place: three such
tensors at the end of backward, beside the gathered weight itself. Here the
loss's backward leaves its gradient in a `WeightGradHandoff`, and the
embedding's backward (which autograd runs after it: the loss is downstream of
the lookup) adds the looked-up rows into that tensor and returns it -- one
buffer. Without a gradient handed over (the loss was not in this backward) the
lookup's backward starts from zeros, as ``F.embedding``'s does.
"""

from __future__ import annotations

import torch


class WeightGradHandoff:
    """Carries the loss's weight gradient to the embedding's backward; one per forward."""

    def __init__(self) -> None:
        self._grad: torch.Tensor | None = None

    def put(self, grad: torch.Tensor) -> None:
        self._grad = grad

    def take(self) -> torch.Tensor | None:
        grad, self._grad = self._grad, None  # the caller's reference is the only one left
        return grad


class _EmbeddingWithHandoff(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, handoff: WeightGradHandoff):
        ctx.save_for_backward(ids)
        ctx.handoff = handoff
        ctx.weight_meta = (weight.shape, weight.dtype, weight.device)
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        shape, dtype, device = ctx.weight_meta
        grad = ctx.handoff.take()
        if grad is None:
            grad = torch.zeros(shape, dtype=dtype, device=device)
        # accumulate=True sums repeated ids (deterministically, also on accelerators).
        grad.index_put_((ids.reshape(-1),), grad_out.reshape(-1, shape[1]).to(dtype), accumulate=True)
        return None, grad, None


def embedding_with_handoff(ids: torch.Tensor, weight: torch.Tensor, handoff: WeightGradHandoff) -> torch.Tensor:
    """``F.embedding(ids, weight)`` whose weight gradient is added into the one
    the chunked loss put in ``handoff`` (same value, one buffer)."""
    return _EmbeddingWithHandoff.apply(ids, weight, handoff)
