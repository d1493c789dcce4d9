"""Deterministic volumes: bytes each rank keeps in persistent buffers, and
bytes communicated per step, against the theory for each strategy.
(Zero-size chunks are exercised by test_dtensor_honesty.)"""

from __future__ import annotations

import itertools
import os

import pytest

import flatfsdp
from flatfsdp.models.gpt import lm_loss
from harness import run_ranks
from training import batches, local_slice, shard_gpt, sharded_step

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
ALGORITHMS = ["exchange", "all_reduce", "native"]
"""gloo: pairwise send/recv exchanges (the default), gradients all-reduced
with each rank keeping its slice, gloo's own collectives."""


def _theory_bytes(strategy: str, numel: int, world: int, bf16: bool) -> float:
    """Persistent bytes per rank for P parameters (none padded in the test model).

    fp32: model weights double as main weights, the kept gradient buffer as the
    main grads. bf16 compute (fp32 main weights, fp32 reduction): bf16 model
    weights, fp32 main weights, fp32 gradients.
    """
    P, W = numel, world
    if not bf16:
        return {"no_shard": 8 * P, "optim": 8 * P, "optim_grads": 4 * P + 4 * P / W,
                "optim_grads_params": 8 * P / W}[strategy]
    return {"no_shard": 2 * P + 4 * P + 4 * P, "optim": 2 * P + 4 * P / W + 4 * P,
            "optim_grads": 2 * P + 8 * P / W, "optim_grads_params": 10 * P / W}[strategy]


def accounting_worker(rank, world):
    out = {}
    x = local_slice(batches(1)[0], rank, world)
    for bf16, algorithm, strategy in itertools.product((False, True), ALGORITHMS, STRATEGIES):
        os.environ["FLATFSDP_GLOO_ALGORITHM"] = algorithm
        model, opt = shard_gpt(strategy, bf16=bf16)
        numel = sum(p.numel() for p in model.parameters())
        # Root and block parameter counts, for the communication theory.
        root_numel = sum(p.numel() for g in model._flatfsdp_state.groups for p in g.params)
        last_numel = sum(p.numel() for p in model.blocks[-1].parameters())
        for _ in range(2):  # the second step is the steady state
            flatfsdp.comm_account().reset()
            lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
        comm = flatfsdp.comm_account().snapshot()
        out[(strategy, bf16, algorithm)] = (flatfsdp.persistent_buffer_bytes(model), numel,
                                            root_numel + last_numel, comm)
    os.environ.pop("FLATFSDP_GLOO_ALGORITHM")
    return out


@pytest.fixture(scope="module", params=[2, 4])
def results(request):
    return request.param, run_ranks(accounting_worker, request.param)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_persistent_bytes_equal_theoretical_share(results, strategy, bf16):
    world, per_rank = results
    for out in per_rank:
        held, numel, _, _ = out[(strategy, bf16, "exchange")]
        assert held == _theory_bytes(strategy, numel, world, bf16), (strategy, bf16, held)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bytes_communicated_per_step_are_the_strategy_minimum(results, strategy, bf16, algorithm):
    world, per_rank = results
    _, numel, kept_numel, comm = per_rank[0][(strategy, bf16, algorithm)]
    weight_bytes = 2 if bf16 else 4
    grad_bytes = 4  # fp32 reduction in both recipes
    # With FLATFSDP_GLOO_ALGORITHM=all_reduce the gradient reduce-scatter runs
    # as an all-reduce of the same buffer; the buffer bytes are the same.
    reduce = "all_reduce" if algorithm == "all_reduce" else "reduce_scatter"
    if strategy == "no_shard":
        expected = {"all_reduce": numel * grad_bytes}
    elif strategy == "optim_grads_params":
        # Gathered for forward, again for backward -- except the root and the
        # last block, kept gathered from their forward to their backward.
        expected = {"all_gather": (2 * numel - kept_numel) * weight_bytes, reduce: numel * grad_bytes}
    else:
        expected = {"all_gather": numel * weight_bytes, reduce: numel * grad_bytes}
    assert {k: v["bytes"] for k, v in comm.items()} == expected


def _reductions_left_worker(rank, world):
    """With the cycle collector off, count the gradient reductions still alive
    after two steps whose reductions each produce a fresh buffer (bf16
    reduction into fp32 main grads): each must die when delivered."""
    import gc

    import torch

    from flatfsdp.engine.comm.coalesce import ReduceRequest

    gc.collect()
    gc.disable()
    try:
        from training import make_model, make_optimizer

        from flatfsdp.models.gpt import TransformerBlock

        model = make_model()
        policy = flatfsdp.MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
        model, opt = flatfsdp.fully_shard(model, make_optimizer("adamw", model.named_parameters()),
                                          fsdp_unit_modules=[TransformerBlock], mixed_precision_policy=policy)
        for x in batches(2):
            sharded_step(model, opt, x, rank, world)
        alive = sum(isinstance(o, ReduceRequest) for o in gc.get_objects())
    finally:
        gc.enable()
    return alive


def test_delivered_reductions_free_their_buffers_without_the_cycle_collector():
    assert run_ranks(_reductions_left_worker, 2) == [0, 0]
