"""The autograd pieces of a unit's hooks: the identity whose backward marks
the end of the unit's backward, and the cast of forward inputs and outputs."""

from __future__ import annotations

from typing import Any

import torch

from flatfsdp.engine.runtime.structures import map_tensors, replace_tensors, tensors_in


class PostBackward(torch.autograd.Function):
    """Identity on the unit's inputs whose backward runs once gradients reach
    them, i.e. once the unit's own backward (parameter gradients included,
    since autograd runs gradient accumulation first) is done."""

    @staticmethod
    def forward(ctx, state, *tensors: torch.Tensor):
        ctx.state = state
        return tensors if len(tensors) != 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        # A unit's backward ran, so the backward has begun, whether or not a
        # pre-backward hook saw it first (a tied head's gradient can come first).
        ctx.state.context.on_backward_start()
        ctx.state.post_backward()
        return (None, *grads)

    @staticmethod
    def register(state, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        inputs = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
        if not inputs:
            return args, kwargs
        outs = PostBackward.apply(state, *inputs)
        outs = (outs,) if isinstance(outs, torch.Tensor) else outs
        return replace_tensors((args, kwargs), iter(outs), lambda t: t.requires_grad)


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x
    return map_tensors(cast, tree)
