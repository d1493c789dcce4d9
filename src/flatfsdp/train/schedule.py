"""The learning rate as a pure function of the step: linear warmup, cosine decay
to --min-lr at --train-iters. Stateless, so a resume needs nothing but the step."""

from __future__ import annotations

import math

from flatfsdp.train.options import TrainOptions, warmup_iters


def lr_at(step: int, o: TrainOptions) -> float:
    """Learning rate of optimizer step ``step`` (1-based)."""
    warmup = warmup_iters(o)
    if step <= warmup:
        return o.lr * step / warmup
    progress = min(1.0, (step - warmup) / max(1, o.train_iters - warmup))
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * progress))
