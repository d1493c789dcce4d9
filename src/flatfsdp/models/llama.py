"""A Llama-shaped decoder: RMSNorm, rotary positions, grouped-query attention,
a SwiGLU feed-forward, no biases, a large vocabulary tied to the output.

It is what the GPU benchmark trains (``python -m flatfsdp.bench --preset gpu``):
on an accelerator the figures users compare against (Megatron-FSDP's, FSDP2's)
are for this shape, not the GPT-2 shape of gpt.py. Like the GPT it knows
nothing about parallelism, initialises every module in ``reset_parameters``
(meta-device builds get the same recipe) and computes its loss a chunk of
tokens at a time (models/chunked_loss.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flatfsdp.models.chunked_loss import chunked_cross_entropy
from flatfsdp.models.gpt import GPTEmbedding, GPTLinear, residual_std
from flatfsdp.models.tied_embedding import WeightGradHandoff


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    """Token ids (Llama 3: 128,256)."""
    n_layer: int = 2
    """Decoder blocks (the natural sharding unit)."""
    n_head: int = 4
    """Query heads; must divide ``d_model``."""
    n_kv_head: int = 1
    """Key/value heads, shared by ``n_head // n_kv_head`` query heads each."""
    d_model: int = 64
    """Width of the residual stream."""
    ffn_dim: int = 256
    """Width of the SwiGLU feed-forward's gate and up projections."""
    rope_theta: float = 500000.0
    """Rotary base (Llama 3's)."""
    norm_eps: float = 1e-5
    loss_chunk_tokens: int = 1024
    """Tokens per chunk of the loss. An accelerator wants large matmuls: 1,024
    tokens of a 128k vocabulary are 0.5 GB of fp32 logits, while the GPT's
    CPU-sized default (16 MB of logits) would cut a 4,096-token sequence into
    128 thin matmuls, each reading the whole 0.5 GB output weight again."""

    @classmethod
    def shaped(cls, n_layer: int, d_model: int, n_head: int, vocab_size: int) -> "LlamaConfig":
        """Llama 3.2 1B's ratios at any size: a key/value head per four query
        heads, a feed-forward four times the width."""
        return cls(vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_kv_head=max(1, n_head // 4),
                   d_model=d_model, ffn_dim=4 * d_model)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


def llama_param_count(config: LlamaConfig) -> int:
    """Parameters of ``Llama(config)``, from the shape alone (the tied
    embedding counted once): what the bench's FLOP and memory figures use
    before a model exists."""
    d, kv = config.d_model, config.n_kv_head * config.head_dim
    attention = d * (d + 2 * kv) + d * d
    per_block = attention + 3 * d * config.ffn_dim + 2 * d  # gate, up, down; two norms
    return config.vocab_size * d + config.n_layer * per_block + d


def rotary_tables(seq: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency), fp32, ``[seq, head_dim // 2]``."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on ``[batch, heads, seq, head_dim]`` (halves rotated, as Llama's checkpoints expect)."""
    first, second = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class GroupedQueryAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        if config.d_model % config.n_head or config.n_head % config.n_kv_head:
            raise ValueError(f"d_model={config.d_model}, n_head={config.n_head}, n_kv_head={config.n_kv_head}: "
                             "heads must divide the width and key/value heads the heads")
        self.config = config
        kv = config.n_kv_head * config.head_dim
        self.qkv = GPTLinear(config.d_model, config.d_model + 2 * kv, bias=False)
        self.proj = GPTLinear(config.d_model, config.d_model, bias=False, std=residual_std(config.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        batch, seq, width = x.shape
        kv = c.n_kv_head * c.head_dim
        q, k, v = self.qkv(x).split([width, kv, kv], dim=-1)
        q = q.view(batch, seq, c.n_head, c.head_dim).transpose(1, 2)
        k, v = (t.view(batch, seq, c.n_kv_head, c.head_dim).transpose(1, 2) for t in (k, v))
        cos, sin = rotary_tables(seq, c.head_dim, c.rope_theta, x.device)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        # Each key/value head repeated for its query heads: every attention
        # backend takes that (enable_gqa is not on all of torch 2.11's).
        group = c.n_head // c.n_kv_head
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class SwiGLU(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_up = GPTLinear(config.d_model, 2 * config.ffn_dim, bias=False)
        self.down = GPTLinear(config.ffn_dim, config.d_model, bias=False, std=residual_std(config.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = GroupedQueryAttention(config)
        self.mlp_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_emb = GPTEmbedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layer))
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                reduction: str = "mean") -> torch.Tensor:
        """Logits ``[batch, seq, vocab]``; with ``targets`` the next-token cross
        entropy instead, the logits never whole (as ``GPT.forward``)."""
        handoff = WeightGradHandoff() if targets is not None and torch.is_grad_enabled() else None
        x = self.tok_emb(idx, handoff)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        if targets is None:
            return F.linear(x, self.tok_emb.weight)
        return chunked_cross_entropy(x, self.tok_emb.weight, targets, reduction=reduction,
                                     chunk_tokens=self.config.loss_chunk_tokens, weight_grad_handoff=handoff)
