"""Model FLOPs of training: what a TFLOP/s figure divides by.

Per token, forward and backward: 6 N for the matmuls (2 a weight forward, 4
backward; N every parameter counted once -- a tied embedding is the output
projection's matmul, its lookup costs nothing; norms, biases and a position
table, counted as if they were weights, are a fraction of a percent) plus
12 L d s for attention's two s x s products (scores and their use), as PaLM
counts it (Chowdhery et al. 2022, appendix B): the whole score matrix, not
halved for the causal mask. The same FLOPs for every contender, so the
figure compares them as step time does, in the unit GPU reports use.
"""

from __future__ import annotations


def flops_per_token(n_params: int, layers: int, d_model: int, seq_len: int) -> int:
    return 6 * n_params + 12 * layers * d_model * seq_len


def step_flops(n_params: int, layers: int, d_model: int, seq_len: int, tokens: int) -> int:
    """FLOPs of one optimizer step over ``tokens`` tokens (one rank's micro batch)."""
    return flops_per_token(n_params, layers, d_model, seq_len) * tokens
