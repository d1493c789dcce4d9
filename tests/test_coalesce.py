"""Coalescing: small param groups share collectives, the count per step drops,
the bytes and the numbers do not change."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flatfsdp
from flatfsdp.models.gpt import GPT, TransformerBlock
from harness import run_ranks
from training import CFG, batches, full_params, make_optimizer, train_with_account

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
CFG4 = dataclasses.replace(CFG, n_layer=4)
EVERYTHING = 1 << 30
"""A bucket (and prefetch depth) larger than the whole test model."""


def _model(strategy: str, bucket_bytes: int, prefetch_bytes: int | None, bf16: bool):
    torch.manual_seed(0)
    model = GPT(CFG4)
    # Block 0 gets a second param group: its first LayerNorm is frozen.
    for p in model.blocks[0].ln1.parameters():
        p.requires_grad_(False)
    opt = make_optimizer("sgd", [(n, p) for n, p in model.named_parameters() if p.requires_grad])
    policy = flatfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else None
    return flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[TransformerBlock], zero_dp_strategy=strategy,
                                bucket_bytes=bucket_bytes, prefetch_bytes=prefetch_bytes,
                                mixed_precision_policy=policy)


def coalescing_worker(rank, world):
    data = batches(3, cfg=CFG4)
    out = {}
    for strategy in STRATEGIES:
        for bf16 in (False, True):
            for mode, bucket, prefetch in (("separate", 0, None), ("coalesced", EVERYTHING, EVERYTHING)):
                model, opt = _model(strategy, bucket, prefetch, bf16)
                losses, comm = train_with_account(model, opt, rank, world, data)
                out[(strategy, bf16, mode)] = (losses, full_params(model), comm)
    return out


@pytest.fixture(scope="module", params=[2, 4])
def results(request):
    return request.param, run_ranks(coalescing_worker, request.param)[0]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_coalescing_changes_neither_numbers_nor_bytes(results, strategy, bf16):
    world, results = results
    sep_losses, sep_params, sep_comm = results[(strategy, bf16, "separate")]
    co_losses, co_params, co_comm = results[(strategy, bf16, "coalesced")]
    if strategy == "no_shard" and world > 2:
        # gloo's ring all-reduce adds the ranks' values in an order that depends
        # on where an element sits in the buffer, and packing moves elements:
        # equal to rounding. (Reduce-scatters are our exchanges, summing in
        # rank order wherever an element sits.)
        # fp32 rounding; under bf16 a rounding flips the last bit of a weight.
        rel = 1e-4 if bf16 else 1e-6
        assert co_losses == pytest.approx(sep_losses, rel=rel)
        for name in sep_params:
            torch.testing.assert_close(co_params[name], sep_params[name], rtol=100 * rel,
                                       atol=2.5e-4 if bf16 else 1e-7)
    else:
        # Packing moves the same elements through the same sums: bitwise equal.
        assert co_losses == sep_losses
        for name in sep_params:
            assert torch.equal(co_params[name], sep_params[name]), name
    assert {k: v["bytes"] for k, v in co_comm.items()} == {k: v["bytes"] for k, v in sep_comm.items()}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_small_groups_share_collectives(results, strategy):
    _, results = results
    _, _, separate = results[(strategy, False, "separate")]
    _, _, coalesced = results[(strategy, False, "coalesced")]
    reduce_kind = "all_reduce" if strategy == "no_shard" else "reduce_scatter"
    # Six param groups (root, block 0 trainable + frozen, blocks 1-3); five of
    # them trainable, each reduced once per step when nothing coalesces...
    assert separate[reduce_kind]["count"] == 5
    # ...and in one collective when the bucket holds them all.
    assert coalesced[reduce_kind]["count"] == 1
    if strategy == "optim_grads_params":
        # Separately: forward gathers all six groups; backward again those of
        # blocks 0-2 (the root and the last block stay gathered): 6 + 4.
        # Coalesced: the root's own gather, then one of every block (the
        # root's prefetch), then one of blocks 0-2 when backward reaches block 3.
        assert separate["all_gather"]["count"] == 10
        assert coalesced["all_gather"]["count"] == 3
    elif strategy in ("optim", "optim_grads"):
        # ZeRO-1/2 gather the updated weights once per step, before forward:
        # the five trainable groups. No optimizer steps the frozen LayerNorm, so
        # its copy, gathered at the first step, stays current.
        assert separate["all_gather"]["count"] == 5
        assert coalesced["all_gather"]["count"] <= 2


def test_joined_stages_keep_every_side_stream_event():
    """On an accelerator each stage's collective ends at an event on its side
    stream; several stages joined as one (HFSDP's outer gathers, chained
    follow-ups) must keep every event, or a wait would read results the side
    stream has not written yet. Events are opaque here (no streams on CPU)."""
    from flatfsdp.engine.comm.collectives import Pending

    first, second, third = object(), object(), object()
    joined = Pending.joined([Pending(events=[first]), Pending(), Pending(events=[second, third])])
    assert joined.events == [first, second, third]
