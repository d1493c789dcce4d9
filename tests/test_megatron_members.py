"""The model the one-call form returns answers Megatron-FSDP's ``MegatronFSDP``
members with Megatron-FSDP's behaviour, on flatfsdp's own buffers; its bound
optimizer takes Megatron-FSDP's keywords; and nothing changes for FSDP2's
per-module form (docs/megatron.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.functional import mse_loss

import flatfsdp
from harness import run_ranks


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.blocks(x))


class OwnNames(Net):
    """A model with names Megatron-FSDP's members use: its own win."""

    def __init__(self):
        super().__init__()
        self.device = "my device"
        self.module = nn.Linear(2, 2)

    def sync(self):
        return "my sync"


def _net(cls=Net):
    torch.manual_seed(0)
    return cls()


def _batches(rank, n=2):
    gen = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)) for _ in range(n)]


def _reference_grads(world, n=2):
    """Gradients of the loss summed over n micro-batches, averaged over ranks."""
    model = _net()
    for r in range(world):
        for x, y in _batches(r, n):
            (mse_loss(model(x), y) / world).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _full_grads(model):
    return {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}


def members_worker(rank, world, strategy):
    out = {}
    policy = flatfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32)
    net = _net()
    model, optimizer = flatfsdp.fully_shard(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                            fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                                            mixed_precision_policy=policy)
    out["what"] = (model.module is model, model.device, model.fsdp_unit_modules, model.mp_policy is policy,
                   model.get_distributed_index() is model.dist_index, model.dist_index.get_fsdp_group().size(),
                   model.ddp_config.data_parallel_sharding_strategy, type(optimizer).__name__,
                   isinstance(optimizer, torch.optim.SGD), "set_model_auto_sync" in dir(model))
    out["marked"] = all(getattr(p, "__fsdp_param__", False) for p in model.parameters())
    out["optimizer_found"] = flatfsdp.fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1)) is not None
    # Auto-sync off: backwards accumulate without communicating; finish_grad_sync reduces them all.
    model.set_model_auto_sync(False)
    for x, y in _batches(rank):
        mse_loss(model(x), y).backward()
    out["unsynced"] = (any(p.grad is not None for p in model.parameters()), model.microbatch_count)
    model.finish_grad_sync()
    out["synced"] = (_full_grads(model), model.microbatch_count)
    model.scale_gradients(0.5)
    out["scaled"] = _full_grads(model)
    # zero_grad_buffer forgets them; the next backward starts from zero.
    model.zero_grad_buffer()
    out["zeroed"] = all(p.grad is None for p in model.parameters())
    model.set_model_auto_sync(True)
    x, y = _batches(rank, 1)[0]
    mse_loss(model(x), y).backward()
    out["one_backward"] = _full_grads(model)
    # The buffers Megatron-LM reads are the engine's own tensors.
    groups = [g for s in model._flatfsdp_state.context.states for g in s.groups]
    views = model.param_and_grad_buffer.parameter_groups
    out["views"] = [(v.main_grad_buffer.data.data_ptr() == g.buffers.main_grad.data_ptr(),
                     v.main_weight_buffer.data.data_ptr() == g.buffers.main.data_ptr()) for v, g in zip(views, groups)]
    optimizer.step(sync_grad_before_optimizer_step=True, install_optimized_model_weights=True)
    optimizer.zero_grad(set_to_none=True, zero_grad_buffer=True)
    model.start_param_sync(force_sync=True)
    # ZeRO-0/1/2 keep the model weights whole: after start_param_sync they hold the stepped weights.
    out["kept_current"] = all(torch.equal(v.model_weight_buffer.get_item(i), p.full_tensor().reshape(-1))
                              for v, g in zip(views, groups) if not v.model_weight_buffer.is_data_distributed
                              for i, p in enumerate(g.sharded_params))
    model.all_gather_and_wait_parameters_ready([model.blocks[0].fc.weight])
    out["gathered"] = model.blocks[0]._flatfsdp_state.is_gathered
    # zero_grad(set_to_none=False) keeps .grad (zeroed); the next backward's gradients are as from None.
    mse_loss(model(x), y).backward()
    first = _full_grads(model)
    optimizer.zero_grad(set_to_none=False)
    out["kept_zero"] = all(p.grad is not None and not p.grad.to_local().any() for p in model.parameters())
    mse_loss(model(x), y).backward()
    out["same_again"] = all(torch.equal(first[n], g) for n, g in _full_grads(model).items())
    return out


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_megatron_members_on_the_one_call_model(strategy):
    reference = _reference_grads(2)
    single = _reference_grads(2, n=1)
    for out in run_ranks(members_worker, 2, strategy):
        assert out["what"] == (True, torch.device("cpu"), [Block], True, True, 2, strategy, "SGD", True, True)
        assert out["marked"] and out["optimizer_found"]
        assert out["unsynced"] == (False, 2)
        grads, count = out["synced"]
        assert count == 0
        for name, grad in reference.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(out["scaled"][name], grad * 0.5, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(out["one_backward"][name], single[name], rtol=1e-6, atol=1e-7)
        assert out["zeroed"]
        assert out["views"] and all(all(v) for v in out["views"]), out["views"]
        assert out["kept_current"] and out["gathered"]
        assert out["kept_zero"] and out["same_again"]


def names_worker(rank, world):
    model = flatfsdp.fully_shard(_net(OwnNames), fsdp_unit_modules=[Block])
    unit = flatfsdp.fully_shard(nn.Linear(4, 4))  # FSDP2's per-module form: no Megatron members
    out = (model.device, type(model.module).__name__, model.sync(), model.model_auto_sync,
           hasattr(unit, "set_model_auto_sync"), [c.__name__ for c in type(unit).__mro__[:3]],
           any(hasattr(p, "__fsdp_param__") for p in unit.parameters()))
    try:
        flatfsdp.fully_shard_optimizer(torch.optim.SGD(unit.parameters(), lr=0.1))
    except TypeError as err:
        return out, str(err)
    return out, None


def test_a_models_own_names_win_and_the_per_module_form_is_unchanged():
    for out, error in run_ranks(names_worker, 2):
        assert out == ("my device", "Linear", "my sync", True, False, ["FSDPLinear", "FSDPModule", "FSDPModule"],
                       False)
        assert error.startswith("fully_shard_optimizer(optimizer) finds the model from the optimizer's parameters")


def broadcast_worker(rank, world):
    """NO_SHARD replicas forced apart after sharding agree again after broadcast_params."""
    model = flatfsdp.fully_shard(_net(), fsdp_unit_modules=[Block], zero_dp_strategy="no_shard")
    with torch.no_grad():
        model.head.weight.to_local().add_(rank)
    apart = model.head.weight.to_local().clone()
    model.broadcast_params()
    return apart, model.head.weight.to_local().clone(), model(torch.ones(1, 8)).detach()


def test_broadcast_params_makes_replicas_agree():
    (apart0, after0, out0), (apart1, after1, out1) = run_ranks(broadcast_worker, 2)
    assert not torch.equal(apart0, apart1)
    assert torch.equal(after0, apart0) and torch.equal(after1, apart0) and torch.equal(out0, out1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)

    def forward(self, x):
        return self.attn(x, x, x)[0]


def meta_worker(rank, world):
    """torch's MultiheadAttention has only _reset_parameters(): meta init uses it."""
    with torch.device("meta"):
        model = nn.Sequential(Attention(), nn.Linear(8, 8))
    flatfsdp.fully_shard(model, fsdp_unit_modules=[Attention], init_model_with_meta_device=True, meta_init_seed=5)
    with torch.no_grad():  # initialises, then releases every unit
        model(torch.ones(2, 1, 8))
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def test_meta_init_falls_back_to_reset_parameters_underscore():
    reference = flatfsdp.reset_parameters(nn.Sequential(Attention(), nn.Linear(8, 8)), 5)
    for full in run_ranks(meta_worker, 2):
        assert full.keys() == dict(reference.named_parameters()).keys()
        for name, p in reference.named_parameters():
            assert torch.equal(full[name], p.detach()), name


def hfsdp_worker(rank, world, outer):
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("outer", "shard"))
    net = _net()
    model, optimizer = flatfsdp.fully_shard(
        net, torch.optim.Adam(net.parameters(), lr=1e-2), device_mesh=mesh, dp_shard_dim="shard",
        dp_outer_dim="outer", hybrid_fsdp_group=mesh._flatten().get_group(), fsdp_unit_modules=[Block],
        outer_dp_sharding_strategy=outer)
    losses = []
    for x, y in _batches(rank, 3):
        loss = mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    index = model.dist_index
    sizes = (index.get_dp_group().size(), index.get_fsdp_group().size(), index.get_outer_fsdp_group().size(),
             index.use_hybrid_fsdp, model.ddp_config.outer_dp_sharding_strategy)
    return losses, sizes


def test_hfsdp_over_a_single_replica_trains_as_fsdp():
    hfsdp, hsdp = run_ranks(hfsdp_worker, 2, "optim"), run_ranks(hfsdp_worker, 2, "no_shard")
    assert [losses for losses, _ in hfsdp] == [losses for losses, _ in hsdp]
    assert all(sizes == (2, 2, 1, True, "no_shard") for _, sizes in hfsdp + hsdp)  # one replica: nothing to split


def hsdp_index_worker(rank, world):
    """HSDP without hybrid_fsdp_group (Megatron-FSDP needs it, flatfsdp derives it): made at first use."""
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("outer", "shard"))
    model = flatfsdp.fully_shard_model(_net(), device_mesh=mesh, dp_shard_dim="shard", dp_outer_dim="outer",
                                       fsdp_unit_modules=[Block])
    index = model.get_distributed_index()
    return index.get_dp_group().size(), index.get_fsdp_group().size(), index.get_outer_fsdp_group().size()


def test_the_distributed_index_of_hsdp_without_a_hybrid_group():
    assert run_ranks(hsdp_index_worker, 2) == [(2, 1, 2)] * 2
