"""The package GPT keeps recipes, not copies, of its layer norms' and GELU's
outputs for backward (models/recompute_saved.py): fewer bytes alive after
forward, bitwise the same loss and gradients."""

from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from flatfsdp.models.gpt import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=100, seq_len=16, n_layer=2, n_head=2, d_model=32)


def _with_recipes(model: GPT, on: bool) -> GPT:
    for block in model.blocks:
        block.remake_activation = block.mlp.remake_activation = on
    return model


def _forward_keeping(model: GPT, x, y):
    """The loss, and the sizes (elements) of the storages forward made that are still alive after it."""
    made: list[weakref.ref] = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            made.extend(weakref.ref(t.untyped_storage()) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
            return out

    with Watch():
        loss = model(x, targets=y)
    gc.collect()
    alive = {s.data_ptr(): s.nbytes() // 4 for ref in made if (s := ref()) is not None}
    return loss, sorted(alive.values())


def test_norm_and_gelu_outputs_are_not_kept_and_gradients_are_bitwise_equal():
    x, y = torch.randint(0, 100, (2, 16)), torch.randint(0, 100, (2, 16))
    results = {}
    for on in (False, True):
        torch.manual_seed(0)
        model = _with_recipes(GPT(CONFIG), on)
        loss, alive = _forward_keeping(model, x, y)
        loss.backward()
        results[on] = loss, alive, {n: p.grad for n, p in model.named_parameters()}
    (plain_loss, plain_alive, plain_grads), (loss, alive, grads) = results[False], results[True]
    assert torch.equal(loss, plain_loss)
    for name, grad in plain_grads.items():
        assert torch.equal(grads[name], grad), name
    tokens, width = 2 * 16, CONFIG.d_model
    per_block_gone = 4 * width * tokens + 2 * width * tokens  # gelu's output, both norms' outputs
    assert sum(plain_alive) - sum(alive) == CONFIG.n_layer * per_block_gone
    assert plain_alive.count(4 * width * tokens) - alive.count(4 * width * tokens) == CONFIG.n_layer
    assert plain_alive.count(width * tokens) - alive.count(width * tokens) == 2 * CONFIG.n_layer


def test_recompute_leaves_saved_tensors_to_the_checkpoint():
    model = GPT(GPTConfig(**{**CONFIG.__dict__, "recompute": "non_reentrant"}))
    assert not any(b.remake_activation or b.mlp.remake_activation for b in model.blocks)
    x = torch.randint(0, 100, (1, 16))
    model(x, targets=x).backward()
    assert all(p.grad is not None for p in model.parameters())
