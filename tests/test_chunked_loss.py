"""The chunked cross-entropy: the same loss and gradients (to 1e-6) as the
logits-then-cross-entropy it replaces, for the package GPT and a Hugging Face
Llama, while autograd keeps nothing of tokens x vocabulary size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flatfsdp.models.chunked_loss import chunked_cross_entropy, default_chunk_tokens
from flatfsdp.models.gpt import GPT, GPTConfig, lm_loss


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _saved_numels(fn) -> list[int]:
    """Element counts of every tensor autograd saves while ``fn`` runs forward."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sizes


def test_chunks_with_ignored_targets_and_a_bias_match_the_plain_loss():
    torch.manual_seed(0)
    hidden = torch.randn(3, 37, 16, requires_grad=True)
    weight, bias = torch.randn(50, 16, requires_grad=True), torch.randn(50, requires_grad=True)
    targets = torch.randint(0, 50, (3, 37))
    targets[0, :5] = -100
    plain = F.cross_entropy(F.linear(hidden, weight, bias).flatten(0, 1), targets.flatten())
    expected = torch.autograd.grad(plain, (hidden, weight, bias))
    chunked = chunked_cross_entropy(hidden, weight, targets, bias=bias, chunk_tokens=7)
    got = torch.autograd.grad(chunked * 1.0, (hidden, weight, bias))
    assert abs(chunked.item() - plain.item()) < 1e-6
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_gpt_loss_equals_the_logits_loss_without_keeping_logits():
    config = GPTConfig(vocab_size=8192, seq_len=600, n_layer=1, n_head=2, d_model=16)
    assert default_chunk_tokens(config.vocab_size) < 2 * 600  # several chunks
    torch.manual_seed(1)
    model = GPT(config)
    x, y = torch.randint(0, 8192, (2, 600)), torch.randint(0, 8192, (2, 600))
    plain, saved_plain = _saved_numels(lambda: lm_loss(model(x), y))
    plain.backward()
    expected = _grads(model)
    chunked, saved_chunked = _saved_numels(lambda: model(x, targets=y))
    chunked.backward()
    got = _grads(model)
    assert abs(chunked.item() - plain.item()) < 1e-6
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)
    logits_numel = 2 * 600 * 8192
    assert max(saved_plain) >= logits_numel  # the plain loss keeps tokens x vocab for backward ...
    assert max(saved_chunked) < logits_numel // 8  # ... the chunked one never does


def test_hf_llama_chunked_loss_equals_its_own_loss():
    transformers = pytest.importorskip("transformers")
    from flatfsdp.models.hf_chunked import use_chunked_loss

    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(2)
    model = transformers.LlamaForCausalLM(config)
    tokens = torch.randint(0, 300, (2, 33))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    names = {n for n, _ in model.named_parameters()}
    plain = lm_loss(model(input_ids=inputs).logits, targets, reduction="sum")
    plain.backward()
    expected = _grads(model)
    use_chunked_loss(model)
    assert {n for n, _ in model.named_parameters()} == names  # same parameters, same names
    chunked = model(input_ids=inputs, labels=targets).loss
    chunked.backward()
    got = _grads(model)
    assert abs(chunked.item() - plain.item()) < 1e-6 * plain.item()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)


def _new_storages_of(numel: int, element_size: int, fn) -> int:
    """How many new storages of exactly ``numel`` elements the ops run by ``fn`` create."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    seen: set[int] = set()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)}
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    ptr = t.untyped_storage().data_ptr()
                    if ptr not in before and t.untyped_storage().nbytes() == numel * element_size:
                        seen.add(ptr)
            return out

    with Count():
        fn()
    return len(seen)


def test_tied_weight_gradient_is_one_buffer_made_in_forward():
    """Backward makes no vocab x width tensor at all: the loss's weight gradient
    is scaled in place and the tied lookup adds its rows into it (autograd
    alone would make three: the scaled copy, the lookup's and their sum)."""
    config = GPTConfig(vocab_size=512, seq_len=32, n_layer=1, n_head=2, d_model=16)
    torch.manual_seed(3)
    model = GPT(config)
    x, y = torch.randint(0, 512, (2, 32)), torch.randint(0, 512, (2, 32))
    loss = model(x, targets=y)
    assert _new_storages_of(512 * 16, 4, loss.backward) == 0
    assert model.tok_emb.weight.grad is not None
    untied = GPT(GPTConfig(vocab_size=512, seq_len=32, n_layer=1, n_head=2, d_model=16, tie_embeddings=False))
    assert _new_storages_of(512 * 16, 4, untied(x, targets=y).backward) == 1  # the lookup's own, as F.embedding


def test_a_second_backward_through_the_loss_is_refused():
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=2, d_model=8))
    loss = model(torch.randint(0, 64, (1, 8)), targets=torch.randint(0, 64, (1, 8)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward through the same loss"):
        loss.backward()
