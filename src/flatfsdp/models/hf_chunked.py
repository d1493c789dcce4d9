"""The chunked loss (chunked_loss.py) for a Hugging Face causal LM, computed
inside the model's own forward.

Inside matters for sharding: the output projection's weight belongs to the
root unit, whose parameters are gathered for the root's forward. So the
model's output Linear is replaced by `HiddenStatesHead` -- the same weight
(and bias) under the same names, so state dicts, tied embeddings and
checkpoints are unchanged -- which hands the hidden states through, and the
model's ``loss_function`` (transformers' documented hook, called in forward
when ``labels`` are given) projects them chunk by chunk. The ``labels`` are
the targets as they are, already shifted: the caller supplies next tokens.

Models that transform their logits after the projection (soft-capping,
scaling) are left alone: `chunking_refused` says why, and the caller falls
back to the model's own logits.
"""

from __future__ import annotations

import torch
from torch import nn

from flatfsdp.models.chunked_loss import chunked_cross_entropy

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


class HiddenStatesHead(nn.Module):
    """Holds an output Linear's parameters; forward returns its input."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


class _ChunkedLoss:
    """The model's ``loss_function``: the summed token loss of hidden states
    ``[batch, seq, d]`` against next-token ``labels`` ``[batch, seq]``."""

    def __init__(self, head: HiddenStatesHead):
        self.head = head

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None, **_ignored):
        return chunked_cross_entropy(logits, self.head.weight, labels, bias=self.head.bias, reduction="sum")


def chunking_refused(model: nn.Module) -> str | None:
    """Why the model's loss cannot be chunked here (None: it can)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        return f"{type(model).__name__}'s output layer is not an nn.Linear"
    config = getattr(model, "config", None)
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            return f"{type(model).__name__} transforms its logits ({name}={value})"
    return None


def use_chunked_loss(model: nn.Module) -> nn.Module:
    """Make ``model(input_ids=..., labels=targets).loss`` the chunked summed
    token loss (and ``.logits`` the final hidden states). Call before sharding."""
    reason = chunking_refused(model)
    if reason:
        raise ValueError(f"cannot chunk the loss: {reason}")
    head = HiddenStatesHead(model.get_output_embeddings())
    model.set_output_embeddings(head)
    model.loss_function = _ChunkedLoss(head)
    return model
