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
