"""Low-bit gradient reduction (grad_reduce_dtype): the reduced gradients
against the exact fp32 average of the ranks' local gradients, within the
documented bound (Note [low-bit gradient error]), and the bytes that moved."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import flatfsdp
from flatfsdp.models.gpt import TransformerBlock, lm_loss
from harness import run_ranks
from training import batches, local_slice, make_model

BLOCK = 16


def _local_grads(rank, world, x):
    """This rank's gradients of its own rows, unsharded, and every rank's."""
    ref = make_model()
    lm_loss(ref(x[:, :-1]), x[:, 1:]).backward()
    mine = {n: p.grad for n, p in ref.named_parameters()}
    every = {}
    for n, g in mine.items():
        parts = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(parts, g)
        every[n] = torch.stack(parts)
    return every


def reduce_worker(rank, world):
    x = local_slice(batches(1)[0], rank, world)
    every = _local_grads(rank, world, x)
    out = {}
    for grad in (None, "bf16", "int8", "e5m2"):
        model = make_model()
        extra = {} if grad is None else {"grad_reduce_dtype": grad}
        flatfsdp.fully_shard(model, fsdp_unit_modules=[TransformerBlock], lowbit_block=BLOCK, **extra)
        flatfsdp.comm_account().reset()
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        reduced = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        out[grad] = (reduced, flatfsdp.comm_account().snapshot()["reduce_scatter"]["bytes"])
    return every, out


@pytest.fixture(scope="module")
def reduced():
    return run_ranks(reduce_worker, 2)[0]


@pytest.mark.parametrize("kind, steps", [("int8", 254), ("e5m2", 14)])
def test_coded_gradients_are_within_their_bound_of_the_exact_average(reduced, kind, steps):
    every, out = reduced
    grads, _ = out[kind]
    worst_ratio, errors, norms = 0.0, 0.0, 0.0
    for n, local in every.items():
        exact = local.mean(0)
        # Each element is one peer's quantized contribution plus the owner's
        # exact one: off by at most the peer's block amax / 254 (int8; e5m2:
        # / 14), averaged over 2 ranks. The largest magnitude of any rank's
        # gradient bounds every block's.
        bound = local.abs().max() / steps / 2
        err = (grads[n] - exact).abs().max()
        worst_ratio = max(worst_ratio, (err / bound).item() if bound > 0 else 0.0)
        errors += (grads[n] - exact).square().sum().item()
        norms += exact.square().sum().item()
    assert worst_ratio <= 1.0 + 1e-4, worst_ratio
    # measured: a fraction of a percent of the gradient's norm (int8), a few percent (e5m2's 2 mantissa bits)
    assert 0 < (errors / norms) ** 0.5 < (0.02 if kind == "int8" else 0.1)


def test_bf16_gradients_are_within_bf16_rounding(reduced):
    every, out = reduced
    grads, _ = out["bf16"]
    for n, local in every.items():
        exact = local.mean(0)
        # Two roundings to bf16 (8 bits) per contribution and one of the sum.
        assert ((grads[n] - exact).abs() <= 2 ** -7 * local.abs().sum(0) / 2 + 1e-12).all(), n


def test_the_account_shows_the_gradient_bytes(reduced):
    _, out = reduced
    fp32, bf16, int8 = out[None][1], out["bf16"][1], out["int8"][1]
    numel = sum(p.numel() for p in make_model().parameters())
    assert fp32 == 4 * numel and bf16 == 2 * numel
    # int8: one byte an element plus an fp32 scale per block, rows 16-byte aligned.
    assert numel * (1 + 4 / BLOCK) <= int8 <= numel * (1 + 4 / BLOCK) + 3 * 2 * 2 * 16


def codec_worker(rank, world):
    """The block-scaled reduce codec on its own, every format, against the sum
    it promises: this rank's chunk exact, then each peer's chunk as its codes
    decode, added in rank order."""
    from flatfsdp.engine.comm.block_reduce import BlockScaledReduce
    from flatfsdp.engine.layout.block_formats import BLOCK_FORMATS, block_format, dequantize_flat, quantize_flat
    from flatfsdp.engine.layout.switches import Transport

    size = 1000 + 3  # several blocks and a short tail
    out = {}
    for name in sorted(BLOCK_FORMATS):
        fmt = block_format(name, block=64)
        torch.manual_seed(10 + rank)
        flat = torch.randn(world * size) * torch.logspace(-4, 4, world * size)
        every = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(every, flat)
        output = torch.empty(size)
        BlockScaledReduce(fmt, Transport()).reduce_scatter(output, flat.clone(), dist.group.WORLD, async_op=True,
                                                          stream=None).wait()
        expected = every[rank][rank * size:(rank + 1) * size].clone()
        for peer in (p for p in range(world) if p != rank):
            codes, scales = torch.empty(size, dtype=torch.uint8), torch.empty(fmt.blocks(size))
            quantize_flat(every[peer][rank * size:(rank + 1) * size], fmt, codes, scales)
            decoded = torch.empty(size)
            dequantize_flat(codes, scales, fmt, decoded)
            expected += decoded
        out[name] = (torch.equal(output, expected), (output - sum(e[rank * size:(rank + 1) * size] for e in every))
                     .abs().max().item())
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_every_block_format_reduces_to_exactly_the_sum_of_its_decoded_codes(world):
    for out in run_ranks(codec_worker, world):
        assert set(out) == {"int8", "fp8", "e5m2"}
        assert all(equal for equal, _ in out.values()), out
        assert out["e5m2"][1] > out["fp8"][1] > out["int8"][1] > 0  # coarser grids, larger errors
