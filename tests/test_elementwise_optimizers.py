"""Elementwise optimizers step the DTensors' chunks with exactly unsharded
arithmetic: on one rank (no reduction to reorder sums) sharded training equals
unsharded training bitwise, for foreach and fused AdamW, default Adam and
SGD, under every strategy. (Against the previous layout, at 2 and 4 ranks, the
results were bitwise unchanged too; see the issue note.)"""

from __future__ import annotations

import pytest
import torch

import flatfsdp
from flatfsdp.models.gpt import TransformerBlock, lm_loss
from harness import run_ranks
from training import batches, full_params, make_model

OPTIMIZERS = {
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1, foreach=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1, fused=True),
    "adam-default": lambda p: torch.optim.Adam(p, lr=3e-3),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd-foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
}
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def _train(model, opt):
    for x in batches(4):
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()


def one_rank_worker(rank, world):
    out = {}
    for name, make in OPTIMIZERS.items():
        ref = make_model()
        _train(ref, make(ref.parameters()))
        reference = {n: p.detach().clone() for n, p in ref.named_parameters()}
        for strategy in STRATEGIES:
            model = make_model()
            model, opt = flatfsdp.fully_shard(model, make(model.parameters()), fsdp_unit_modules=[TransformerBlock],
                                              zero_dp_strategy=strategy)
            _train(model, opt)
            got = full_params(model)
            out[(name, strategy)] = all(torch.equal(got[n], reference[n]) for n in reference)
    return out


@pytest.fixture(scope="module")
def one_rank():
    return run_ranks(one_rank_worker, 1)[0]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sharded_steps_are_unsharded_arithmetic(one_rank, name, strategy):
    assert one_rank[(name, strategy)]
