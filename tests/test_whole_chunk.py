"""A rank whose chunk is the whole group (world 1; HSDP replicas of one rank)
keeps no second, compute-dtype copy of its weights under ZeRO-3: each gather
casts the main weights (comm/cast_gather.py). bf16 compute then costs 16
bytes a parameter, as FSDP2's, not 18; in fp32 the gathered buffer is the
main weights themselves, and a step holds what ZeRO-2 holds at one rank."""

from __future__ import annotations

import pytest
import torch

import flatfsdp
from flatfsdp.estimator import estimate
from harness import run_ranks
from training import batches, shard_gpt, train_reference, train_sharded

STEPS = 3


@pytest.mark.parametrize("world, shard_size, bf16, expected", [(1, None, True, 16), (2, 1, True, 16),
                                                               (2, None, True, 18), (1, None, False, 16)])
def test_bytes_a_parameter(world, shard_size, bf16, expected):
    [(layout, figures)] = estimate("gpt-tiny", [world], shard_size=shard_size, bf16=bf16, micro_batch=1,
                                   seq_len=32)
    held = sum(figures.persistent.values()) * layout.shard / figures.params
    assert held == pytest.approx(expected, abs=0.01)  # padding aside
    assert (figures.persistent["model weights"] == 0) == (layout.shard == 1)
    if layout.shard == 1:
        assert figures.comm.get("dp_shard", {}).get("all_gather") is None  # nothing travels to gather


def whole_chunk_worker(rank: int, world: int) -> dict:
    model, optimizer = shard_gpt("optim_grads_params", bf16=True, opt_name="adamw")
    roles = flatfsdp.persistent_bytes_by_role(model)
    params = sum(p.numel() for p in model.parameters())
    losses = train_sharded(model, optimizer, rank, world, batches(STEPS))
    return dict(roles=roles, params=params, losses=losses)


def test_a_real_rank_alone_keeps_16_bytes_a_parameter_and_trains_as_before():
    out = run_ranks(whole_chunk_worker, 1)[0]
    assert out["roles"]["model weights"] == 0
    assert out["roles"]["main weights"] == out["roles"]["gradients"] >= 4 * out["params"]
    ref_losses, _ = train_reference(STEPS, "adamw", True)
    # The same recipe as the unsharded bf16 reference (bf16 rounding of the casts aside).
    assert max(abs(a - b) for a, b in zip(out["losses"], ref_losses)) < 5e-3
    assert torch.tensor(out["losses"]).isfinite().all()


def test_alone_in_fp32_zero3_holds_what_zero2_holds():
    zero2, zero3 = (estimate("gpt-tiny", [1], strategy=s, micro_batch=1, seq_len=32)[0][1]
                    for s in ("optim_grads", "optim_grads_params"))
    assert zero3.persistent == zero2.persistent
    assert zero3.engine_transient_peak == zero2.engine_transient_peak  # nothing gathered comes and goes
    assert "all_gather" not in zero3.comm["world"]


def released_worker(rank: int, world: int) -> dict:
    """Which blocks hold gathered weights once the forward is over, and, as
    each block's backward ends, which later blocks still hold a gradient
    accumulation buffer (a reduction not yet landed), in the second step."""
    from flatfsdp.engine.runtime.unit_state import unit_states
    from flatfsdp.models.gpt import lm_loss

    # No coalescing: each block's reduction is issued as its backward ends (as a
    # unit above the bucket size is), not held in an open bucket with the next.
    model, optimizer = shard_gpt("optim_grads_params", bf16=True, opt_name="adamw", bucket_bytes=0)
    blocks = list(model.blocks)
    states = [unit_states(block)[0] for block in blocks]
    gathered = [lambda s=s: any(g.buffers.unsharded.is_allocated for g in s.groups) for s in states]
    accumulating = [lambda s=s: any(g.buffers.grads.is_allocated for g in s.groups) for s in states]
    held: list[list[int]] = []

    def watch(k):
        def pre(module, args):
            if args[0].requires_grad:
                args[0].register_hook(lambda grad: held.append([j for j in range(k + 1, len(blocks))
                                                                if accumulating[j]()]))
        return pre

    for k, block in enumerate(blocks):
        block.register_forward_pre_hook(watch(k))
    after_forward = []
    for x in batches(2):
        held.clear()
        x = x[rank::world]
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        after_forward = [k for k in range(len(blocks)) if gathered[k]()]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return dict(after_forward=after_forward, held=list(held), blocks=len(blocks))


def test_alone_nothing_gathered_or_reduced_waits_beside_the_loss_or_the_next_backward():
    """At one rank a block's gather is a cast and its reduction a copy: the
    last block is not kept gathered through the loss (FSDP2 keeps none; an
    H200's peak was one block's bf16 weights above FSDP2's), and no block's
    reduction stays in flight holding its fp32 accumulation buffer while
    the next blocks' backward runs. With two ranks the last block stays
    gathered: its gather travels, and releasing it would gather it again."""
    alone = run_ranks(released_worker, 1)[0]
    assert alone["blocks"] >= 2
    assert alone["after_forward"] == []
    assert alone["held"] == [[]] * alone["blocks"]
    pair = run_ranks(released_worker, 2)[0]
    assert pair["after_forward"] == [pair["blocks"] - 1]
