"""Bad input fails at once with an error that names the culprit."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import flatfsdp
from flatfsdp.models.gpt import TransformerBlock
from harness import run_ranks
from training import make_model


def _error_of(fn):
    try:
        fn()
    except Exception as err:  # the test asserts on type and text
        return type(err).__name__, str(err)
    return None


def _with_optimizer(params):
    model = make_model()
    extra = nn.Linear(3, 5)
    opt = torch.optim.SGD(list(model.parameters()) + list(extra.parameters()), lr=0.1)
    return flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[TransformerBlock])


def _twice():
    model = make_model()
    flatfsdp.fully_shard(model.blocks[0])
    flatfsdp.fully_shard(model.blocks[0])


def _tied_across_units():
    model = make_model()
    flatfsdp.fully_shard(model.tok_emb)  # its weight is also lm_head's, outside this unit
    flatfsdp.fully_shard(model)
    model(torch.zeros(1, 4, dtype=torch.long))


def _tied_in_sibling_units(strategy):
    """FSDP2 style: the two users of a tied weight sharded as separate units."""
    model = make_model()
    flatfsdp.fully_shard(model.tok_emb, zero_dp_strategy=strategy)
    flatfsdp.fully_shard(model.lm_head, zero_dp_strategy=strategy)
    flatfsdp.fully_shard(model, zero_dp_strategy=strategy)
    model(torch.zeros(1, 4, dtype=torch.long))


def errors_worker(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    cases = {
        "bad_module_path": lambda: flatfsdp.fully_shard(make_model(), fsdp_unit_modules=["no_such_pkg.Block"]),
        "bad_attr_path": lambda: flatfsdp.fully_shard(
            make_model(), fsdp_unit_modules=["flatfsdp.models.gpt.NoSuchBlock"]),
        "class_not_in_model": lambda: flatfsdp.fully_shard(make_model(), fsdp_unit_modules=[nn.Conv2d]),
        "bad_mesh_dim": lambda: flatfsdp.fully_shard(make_model(), device_mesh=mesh, dp_shard_dim="dp_shard",
                                                     fsdp_unit_modules=[TransformerBlock]),
        "foreign_optimizer_param": lambda: _with_optimizer(None),
        "sharded_twice": _twice,
        "unknown_strategy": lambda: flatfsdp.fully_shard(make_model(), zero_dp_strategy="zero4"),
        "tied_across_units": _tied_across_units,
        # At one rank both strategies find it at the first forward (a ZeRO-3
        # chunk that is the whole group keeps its weights: nothing released).
        "tied_in_sibling_units_zero3": lambda: _tied_in_sibling_units("optim_grads_params"),
        "tied_in_sibling_units_zero2": lambda: _tied_in_sibling_units("optim_grads"),
    }
    return {name: _error_of(fn) for name, fn in cases.items()}


@pytest.fixture(scope="module")
def errors():
    return run_ranks(errors_worker, 1)[0]


@pytest.mark.parametrize("case, kind, words", [
    ("bad_module_path", "ValueError", ["no_such_pkg.Block", "cannot import"]),
    ("bad_attr_path", "ValueError", ["flatfsdp.models.gpt.NoSuchBlock", "no attribute 'NoSuchBlock'"]),
    ("class_not_in_model", "ValueError", ["torch.nn.modules.conv.Conv2d", "GPT"]),
    ("bad_mesh_dim", "ValueError", ["'dp_shard'", "['dp']"]),
    ("foreign_optimizer_param", "ValueError", ["param_groups[0]['params'][", "(5, 3)", "not a parameter"]),
    ("sharded_twice", "ValueError", ["TransformerBlock", "already sharded"]),
    ("unknown_strategy", "ValueError", ["'zero4'", "optim_grads_params"]),
    ("tied_across_units", "ValueError", ["lm_head.weight", "'tok_emb'"]),
    ("tied_in_sibling_units_zero3", "ValueError", ["lm_head.weight", "already managed by another sharded unit",
                                                   "'tok_emb'"]),
    ("tied_in_sibling_units_zero2", "ValueError", ["lm_head.weight", "already managed by another sharded unit",
                                                   "'tok_emb'"]),
])
def test_bad_input_names_the_culprit(errors, case, kind, words):
    assert errors[case] is not None, f"{case}: no error raised"
    got_kind, message = errors[case]
    assert got_kind == kind, (case, got_kind, message)
    for word in words:
        assert word in message, (case, word, message)
