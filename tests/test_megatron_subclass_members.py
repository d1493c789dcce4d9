"""Megatron-FSDP's ``MegatronFSDP`` members on a model whose weights are
tensor subclasses (torchao float8 training weights, NF4 QLoRA bases), sharded
by the one-call door: every member answers, the parameter groups' buffers are
real tensors holding the values the subclass weights hold, and calling the
members changes nothing about training (docs/megatron.md, issue 44).

Both kinds of group answer through one typed face (groups/group_core's
``ParamGroupFace.tensors()``); a subclass group's weight buffers are flat
copies of its weights' plain values, its main-grad buffer the engine's own.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import flatfsdp
from flatfsdp.engine.groups.group_core import ParamGroupFace
from device_world import Block, regression_data
from harness import run_ranks
from test_subclass_params import D, QBlock, _float8_net, _qlora_net

ROWS, STEPS = 16, 3


def _subclass_weights(net) -> dict[str, torch.Tensor]:
    """Each tensor-subclass weight's full plain values (float8: its high-precision
    tensor; NF4: what it dequantizes to), before sharding."""
    out = {}
    for name, p in net.named_parameters():
        if hasattr(p, "_tensor"):
            out[name] = p._tensor.detach().clone()
        elif hasattr(p, "get_original_weight"):
            out[name] = p.get_original_weight().detach().clone()
    return out


def _plain_local(p: torch.Tensor) -> torch.Tensor:
    local = p._local_tensor
    return (local._tensor if hasattr(local, "_tensor") else local.get_original_weight()).reshape(-1)


def _engine_groups(model):
    """The engine's groups in param_and_grad_buffer's order (its units' states, in module order)."""
    from flatfsdp.engine.runtime.unit_state import unit_states
    return [g for s in unit_states(model) for g in s.groups]


def _probe_buffers(model, names: dict, full: dict, rank: int, world: int) -> dict:
    """Every parameter group's three buffers: real tensors with the values the weights hold."""
    out = {"groups": 0, "subclass_groups": 0, "main_checked": 0, "model_checked": 0, "grad_checked": 0,
           "mismatch": []}
    buffer = model.param_and_grad_buffer
    assert buffer.num_buckets == len(buffer.parameter_groups) == len(_engine_groups(model))
    for view, group in zip(buffer.parameter_groups, _engine_groups(model)):
        out["groups"] += 1
        model_buf = view.model_weight_buffer
        assert isinstance(model_buf.data, torch.Tensor) and type(model_buf.data) is torch.Tensor
        assert view.dtype == model_buf.dtype and view.requires_grad == group.trainable
        subclass = [names[id(p)] in full for p in group.sharded_params]
        if any(subclass):
            out["subclass_groups"] += 1
        for i, p in enumerate(group.sharded_params):
            name = names[id(p)]
            if name not in full:
                continue
            mine = full[name].chunk(world)[rank].reshape(-1)
            if not torch.equal(model_buf.get_item(i), mine.to(model_buf.dtype)):
                out["mismatch"].append(("model", name))
            out["model_checked"] += 1
            if view.main_weight_buffer is not None:
                main = view.main_weight_buffer
                assert type(main.data) is torch.Tensor and main.is_data_distributed
                if not (torch.equal(main.get_item(i), mine) and torch.equal(main.get_item(i), _plain_local(p))):
                    out["mismatch"].append(("main", name))
                out["main_checked"] += 1
            if view.main_grad_buffer is not None and p.grad is not None:  # (None after zero_grad_buffer)
                grad = view.main_grad_buffer
                assert type(grad.data) is torch.Tensor and grad.dtype == view.grad_dtype
                if not torch.equal(grad.get_item(i), p.grad.to_local().reshape(-1)):
                    out["mismatch"].append(("grad", name))
                out["grad_checked"] += 1
    return out


def members_worker(rank, world, kind: str, call_members: bool):
    if kind == "float8":
        net, unit, width = _float8_net(True), Block, D
    else:
        net, unit, width = _qlora_net(), QBlock, 64
    full = _subclass_weights(net)
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    policy = flatfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32)
    model, optimizer = flatfsdp.fully_shard(net, optimizer, fsdp_unit_modules=[unit],
                                            mixed_precision_policy=policy)
    names = {id(p): n for n, p in model.named_parameters()}  # the sharded parameters, by name
    out = {"face": sorted({type(g).__name__ for g in _engine_groups(model) if isinstance(g, ParamGroupFace)})}
    data = regression_data(width, ROWS, STEPS + 1)
    per = ROWS // world
    if call_members:
        x, y = data[-1]
        F.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        model.finish_grad_sync()
        out["buffers"] = _probe_buffers(model, names, full, rank, world)
        buffer = model.param_and_grad_buffer
        buffer.update_main_grads()
        buffer.scale_gradients(0.5)
        buffer.copy_main_weights_to_model_weights()
        model.broadcast_params()
        model.start_param_sync(force_sync=True)
        model.all_gather_and_wait_parameters_ready(list(model.parameters())[:1])
        model.synchronize_param_gather()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        out["after_calls"] = _probe_buffers(model, names, full, rank, world)["mismatch"]
    losses = []
    for x, y in data[:STEPS]:
        loss = F.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / world)
    out["losses"] = losses
    if call_members:  # trained: the main weights still are what the subclass weights hold
        mismatch = []
        buffer = model.param_and_grad_buffer
        for view, group in zip(buffer.parameter_groups, _engine_groups(model)):
            for i, p in enumerate(group.sharded_params):
                if names[id(p)] in full and view.main_weight_buffer is not None:
                    if not torch.equal(view.main_weight_buffer.get_item(i), _plain_local(p)):
                        mismatch.append(names[id(p)])
        out["trained_main"] = mismatch
    return out


@pytest.mark.parametrize("kind", ["float8", "nf4"])
def test_every_megatron_member_works_on_subclass_weights(kind):
    called = run_ranks(members_worker, 2, kind, True)
    plain = run_ranks(members_worker, 2, kind, False)
    for with_calls, without in zip(called, plain):
        probe = with_calls["buffers"]
        assert probe["mismatch"] == [] and with_calls["after_calls"] == [], probe
        assert probe["subclass_groups"] >= 1 and probe["model_checked"] >= 2, probe
        if kind == "float8":  # trainable float8 weights: main weights and grads checked too
            assert probe["main_checked"] == probe["model_checked"] == probe["grad_checked"], probe
        else:  # frozen NF4 bases: no main weights or grads; the adapters' groups have them
            assert probe["main_checked"] == probe["grad_checked"] == 0, probe
        assert with_calls["trained_main"] == []
        # Both kinds of group show the one declared face (flat: the NF4 model's adapters).
        assert with_calls["face"] == (["SubclassGroup"] if kind == "float8" else ["ParamGroup", "SubclassGroup"])
        assert with_calls["losses"] == without["losses"]
    assert called[0]["losses"] == called[1]["losses"]
