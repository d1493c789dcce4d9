"""Distributed checkpoints of sharded models: saved at 4 ranks under every
strategy, loaded at 2 and 1 and into a plain model through torch's own DCP
tools, and resumed with bitwise-identical losses."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor

from harness import run_ranks
from training import batches, make_model, shard_gpt, sharded_step

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def _full(tree):
    """Full plain tensors from a (nested) state dict of DTensors, keyed by name."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in _full(value).items()})
        elif isinstance(value, DTensor):
            out[key] = value.full_tensor().clone()
        elif isinstance(value, torch.Tensor):
            out[key] = value.clone()
    return out


def save_worker(rank, world, root):
    saved = {}
    for strategy in STRATEGIES:
        model, opt = shard_gpt(strategy, opt_name="adamw")
        for x in batches(3):
            sharded_step(model, opt, x, rank, world)
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.save(state, checkpoint_id=f"{root}/{strategy}")
        saved[strategy] = _full({"model": state["model"], "optim": state["optim"]["state"]})
        saved[(strategy, "keys")] = sorted(state["model"])
    return saved


def load_worker(rank, world, root, load_strategy):
    loaded = {}
    for strategy in STRATEGIES:
        model, opt = shard_gpt(load_strategy, opt_name="adamw")
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(state, checkpoint_id=f"{root}/{strategy}")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        fresh = {"model": model.state_dict(), "optim": opt.state_dict()}
        loaded[strategy] = _full({"model": fresh["model"], "optim": fresh["optim"]["state"]})
    return loaded


def resume_worker(rank, world, root):
    data = batches(6, seed=11)
    model, opt = shard_gpt("optim_grads_params", opt_name="adamw")
    straight = [sharded_step(model, opt, x, rank, world) for x in data]
    model, opt = shard_gpt("optim_grads_params", opt_name="adamw")
    for x in data[:3]:
        sharded_step(model, opt, x, rank, world)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=f"{root}/resume")
    model, opt = shard_gpt("optim_grads_params", opt_name="adamw")
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=f"{root}/resume")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    resumed = [sharded_step(model, opt, x, rank, world) for x in data[3:]]
    return straight[3:], resumed


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return root, run_ranks(save_worker, 4, str(root))[0]


def _assert_same(saved, loaded, what):
    assert saved.keys() == loaded.keys(), (what, sorted(set(saved) ^ set(loaded)))
    for key in saved:
        assert saved[key].shape == loaded[key].shape, (what, key)
        assert torch.equal(saved[key].to(loaded[key].dtype), loaded[key]), (what, key)


def test_state_dict_keys_are_the_unsharded_names_at_true_shapes(checkpoints):
    _, saved = checkpoints
    plain = make_model()
    for strategy in STRATEGIES:
        assert saved[(strategy, "keys")] == sorted(plain.state_dict())
        for name, tensor in plain.state_dict().items():
            assert saved[strategy][f"model.{name}"].shape == tensor.shape


@pytest.mark.parametrize("world, load_strategy", [(2, "optim_grads_params"), (2, "optim"), (1, "no_shard"),
                                                  (1, "optim_grads_params")])
def test_checkpoint_from_4_ranks_loads_at_other_sizes_and_strategies(checkpoints, world, load_strategy):
    root, saved = checkpoints
    loaded = run_ranks(load_worker, world, str(root), load_strategy)[0]
    for strategy in STRATEGIES:
        _assert_same(saved[strategy], loaded[strategy], (strategy, world, load_strategy))
        assert any(".step" in k for k in loaded[strategy]) and any("exp_avg_sq" in k for k in loaded[strategy])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_torch_dcp_to_torch_save_gives_a_plain_loadable_model(checkpoints, tmp_path, strategy):
    root, saved = checkpoints
    dcp_to_torch_save(f"{root}/{strategy}", tmp_path / "plain.pt")
    plain_state = torch.load(tmp_path / "plain.pt", weights_only=True)
    model = make_model(seed=123)
    model.load_state_dict(plain_state["model"], strict=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[strategy][f"model.{name}"]), name


def test_resumed_run_continues_with_bitwise_identical_losses(tmp_path):
    straight, resumed = run_ranks(resume_worker, 2, str(tmp_path))[0]
    assert [t.item() for t in straight] == [t.item() for t in resumed]
