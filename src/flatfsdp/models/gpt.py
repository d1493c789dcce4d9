"""A small decoder-only transformer (GPT-2 shape) used by the training command,
the benchmark and the tests.

Every module with parameters initialises itself in ``reset_parameters`` (GPT-2
style: small normal weights, residual projections scaled by depth), so a model
built on the meta device and materialised unit by unit gets the same init
recipe as one built normally -- there is no whole-model init pass to miss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from flatfsdp.models import recompute_saved
from flatfsdp.models.chunked_loss import chunked_cross_entropy
from flatfsdp.models.tied_embedding import WeightGradHandoff, embedding_with_handoff


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    """Number of token ids (256 for the byte-level tokenizer)."""
    seq_len: int = 64
    """Longest sequence the position table covers."""
    n_layer: int = 2
    """Number of transformer blocks (the natural sharding unit)."""
    n_head: int = 2
    """Attention heads per block; must divide ``d_model``."""
    d_model: int = 64
    """Width of the residual stream."""
    tie_embeddings: bool = True
    """Share the token embedding with the output projection."""
    recompute: str = "none"
    """Activation recompute per block: "none", "reentrant" or "non_reentrant"
    (torch.utils.checkpoint), trading compute for activation memory."""


INIT_STD = 0.02
"""GPT-2's weight init standard deviation."""


class GPTLinear(nn.Linear):
    """A Linear initialised N(0, std^2) with a zero bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, std: float = INIT_STD):
        object.__setattr__(self, "std", std)  # nn.Linear.__init__ calls reset_parameters
        super().__init__(in_features, out_features, bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class GPTEmbedding(nn.Embedding):
    """An Embedding initialised N(0, INIT_STD^2)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=INIT_STD)

    def forward(self, idx: torch.Tensor, grad_handoff: WeightGradHandoff | None = None) -> torch.Tensor:
        """``grad_handoff``: the weight is also the chunked loss's output
        projection; its gradient is added into the loss's (tied_embedding.py)."""
        if grad_handoff is None:
            return super().forward(idx)
        return embedding_with_handoff(idx, self.weight, grad_handoff)


class TokenEmbedding(GPTEmbedding):
    """The token table: a class of its own, so that a wrapping policy can name
    it apart from the (small) position table."""


class OutputHead(GPTLinear):
    """The output projection. Given ``targets`` it returns the chunked loss
    instead of logits; either way the head is *called*, never reached into for
    its weight, so hooks on it (a wrapper's) see its forward and backward."""

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__(d_model, vocab_size, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, *, reduction: str = "mean",
                weight_grad_handoff: WeightGradHandoff | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        return chunked_cross_entropy(x, self.weight, targets, reduction=reduction,
                                     weight_grad_handoff=weight_grad_handoff)


def residual_std(n_layer: int) -> float:
    """Projections into the residual stream shrink with depth (GPT-2; the Llama too)."""
    return INIT_STD / math.sqrt(2 * n_layer)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.d_model % config.n_head:
            raise ValueError(f"d_model={config.d_model} is not divisible by n_head={config.n_head}")
        self.n_head = config.n_head
        self.qkv = GPTLinear(config.d_model, 3 * config.d_model)
        self.proj = GPTLinear(config.d_model, config.d_model, std=residual_std(config.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        shape = (batch, seq, self.n_head, width // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = GPTLinear(config.d_model, 4 * config.d_model)
        self.proj = GPTLinear(4 * config.d_model, config.d_model, std=residual_std(config.n_layer))
        self.remake_activation = config.recompute == "none"
        """Under activation checkpointing the block's saved tensors are its business."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.fc(x)
        act = F.gelu(pre, approximate="tanh")
        if not (self.remake_activation and recompute_saved.applies(act)):
            return self.proj(act)
        # gelu keeps `pre` for its backward; `proj` would keep `act` too (4 x
        # width per token). It keeps the recipe instead: one more gelu in backward.
        with recompute_saved.remade_when_needed(act, lambda: F.gelu(pre, approximate="tanh")):
            return self.proj(act)


class TransformerBlock(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)
        self.remake_activation = config.recompute == "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._normed_into(self.ln1, x, self.attn)
        return x + self._normed_into(self.ln2, x, self.mlp)

    def _normed_into(self, norm: nn.LayerNorm, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        """``layer(norm(x))``; the norm keeps ``x`` for its backward, so the
        layer's first Linear keeps the recipe of ``norm(x)``, not a copy."""
        normed = norm(x)
        if not (self.remake_activation and recompute_saved.applies(normed)):
            return layer(normed)
        remake = lambda: F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)  # noqa: E731
        with recompute_saved.remade_when_needed(normed, remake):
            return layer(normed)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.recompute not in ("none", "reentrant", "non_reentrant"):
            raise ValueError(f"recompute must be none, reentrant or non_reentrant, got {config.recompute!r}")
        self.config = config
        self.tok_emb = TokenEmbedding(config.vocab_size, config.d_model)
        self.pos_emb = GPTEmbedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = OutputHead(config.d_model, config.vocab_size)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                reduction: str = "mean") -> torch.Tensor:
        """Logits ``[batch, seq, vocab]``; with ``targets`` ``[batch, seq]``
        instead the next-token cross entropy ("mean" or "sum" over tokens),
        computed a chunk of tokens at a time so the logits never exist whole
        (models/chunked_loss.py)."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        # Tied weights: one vocab x width gradient buffer, shared by the loss and the lookup.
        tied = targets is not None and self.lm_head.weight is self.tok_emb.weight and torch.is_grad_enabled()
        handoff = WeightGradHandoff() if tied else None
        x = self.tok_emb(idx, handoff) + self.pos_emb(positions)
        for block in self.blocks:
            if self.config.recompute == "none":
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.config.recompute == "reentrant")
        # A sharding engine may give the head a leaf of its own viewing the
        # shared weight (flatfsdp's row lookups), so that the head's gradient
        # arrives apart from the lookup's: then it goes to that leaf, not through the handoff.
        shared = handoff if self.lm_head.weight is self.tok_emb.weight else None
        return self.lm_head(self.ln_f(x), targets, reduction=reduction, weight_grad_handoff=shared)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross entropy in fp32, whatever the compute dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)

