"""Sharded training equals unsharded training: every strategy, world sizes 1, 2
and 4, fp32 and bf16 compute with fp32 main weights."""

from __future__ import annotations

import pytest

from harness import run_ranks
from training import batches, full_params, max_diff, shard_gpt, train_reference, train_sharded

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
STEPS = 20


def parity_worker(rank: int, world: int) -> dict:
    data = batches(STEPS)
    out = {"ref": {}, "run": {}}
    for opt_name, bf16 in (("adamw", False), ("sgd", False), ("adamw", True)):
        key = f"{opt_name}-{'bf16' if bf16 else 'fp32'}"
        out["ref"][key] = train_reference(STEPS, opt_name, bf16)
        for strategy in STRATEGIES:
            model, opt = shard_gpt(strategy, bf16=bf16, opt_name=opt_name)
            losses = train_sharded(model, opt, rank, world, data)
            out["run"][(key, strategy)] = (losses, full_params(model))
    return out


@pytest.fixture(scope="module", params=[1, 2, 4])
def results(request):
    world = request.param
    return world, run_ranks(parity_worker, world)[0]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fp32_adamw_losses_match_reference(results, strategy):
    world, out = results
    ref_losses, ref_params = out["ref"]["adamw-fp32"]
    losses, params = out["run"][("adamw-fp32", strategy)]
    worst = max(_rel(a, b) for a, b in zip(losses, ref_losses))
    assert worst < 1e-5, f"{strategy} world {world}: losses {losses} vs {ref_losses}"
    # Adam amplifies round-off on near-zero gradients up to about the learning rate.
    assert max_diff(params, ref_params) < 2 * 3e-3 * STEPS


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fp32_sgd_params_match_reference(results, strategy):
    world, out = results
    ref_losses, ref_params = out["ref"]["sgd-fp32"]
    losses, params = out["run"][("sgd-fp32", strategy)]
    assert max(_rel(a, b) for a, b in zip(losses, ref_losses)) < 1e-5
    assert max_diff(params, ref_params) < 1e-5, f"{strategy} world {world}"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bf16_losses_match_same_recipe_reference(results, strategy):
    world, out = results
    ref_losses, _ = out["ref"]["adamw-bf16"]
    losses, _ = out["run"][("adamw-bf16", strategy)]
    assert max(_rel(a, b) for a, b in zip(losses, ref_losses)) < 2e-2, (losses, ref_losses)
    # ... and training does make progress in bf16.
    assert sum(losses[-5:]) < sum(losses[:5])
