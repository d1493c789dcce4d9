"""No process-wide state: importing flatfsdp registers nothing, sharding and
binding set no attribute on torch's objects, and runtime state belongs to the
sharded model -- with regression tests for the two bugs a global optimizer
hook and a global weights epoch caused."""

from __future__ import annotations

import subprocess
import sys

import torch

import flatfsdp
from flatfsdp.models.gpt import TransformerBlock, lm_loss
from harness import run_ranks
from training import batches, full_params, local_slice, make_model, max_diff, shard_gpt


def test_importing_flatfsdp_registers_no_global_hook():
    code = ("import torch, flatfsdp\n"
            "from torch.optim import optimizer as o\n"
            "from torch.nn.modules import module as m\n"
            "hooks = [o._global_optimizer_pre_hooks, o._global_optimizer_post_hooks,\n"
            "         m._global_forward_pre_hooks, m._global_forward_hooks, m._global_backward_hooks,\n"
            "         m._global_module_registration_hooks, m._global_parameter_registration_hooks]\n"
            "assert not any(hooks), hooks\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def attributes_worker(rank, world):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_before = set(vars(opt))
    model, opt = flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[TransformerBlock])
    flatfsdp.fully_shard_optimizer(opt, model)  # binding twice adds nothing either
    x = local_slice(batches(1)[0], rank, world)
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    opt.step()
    extra = sorted(set(vars(opt)) - opt_before)
    param_attrs = sorted({k for p in model.parameters() for k in vars(p)})
    return extra, param_attrs, len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)


def test_binding_sets_no_attribute_on_the_optimizer_or_parameters():
    for extra, param_attrs, pre, post in run_ranks(attributes_worker, 2):
        assert extra == [], extra
        assert not any("flatfsdp" in a for a in param_attrs), param_attrs
        assert (pre, post) == (1, 1)  # one hook pair, through the optimizer's own API


# ---- bug 1: an optimizer the engine never bound, with deferred reductions -------------------

def unbound_worker(rank, world):
    """FSDP2 style: units sharded one by one with sync_model_each_microbatch=False,
    the optimizer built afterwards on the sharded parameters (never bound)."""
    data = batches(3, seed=2)
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model = make_model()
    for block in model.blocks:
        flatfsdp.fully_shard(block, sync_model_each_microbatch=False)
    flatfsdp.fully_shard(model, sync_model_each_microbatch=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    distances = []
    for x in data:
        lm_loss(ref(x[:, :-1]), x[:, 1:]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        xs = local_slice(x, rank, world)
        lm_loss(model(xs[:, :-1]), xs[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        distances.append(max_diff(full_params(model), {n: p.detach() for n, p in ref.named_parameters()}))
    return distances


def test_an_unbound_optimizer_steps_each_microbatch_with_deferred_reductions():
    # Before: step 1 found the gradients still in flight and moved nothing;
    # step 2 applied both microbatches.
    for distances in run_ranks(unbound_worker, 2):
        assert max(distances) < 1e-5, distances


# ---- bug 2: two models in one process ----------------------------------------------------

def two_models_worker(rank, world):
    data = batches(3, seed=8)
    a, opt_a = shard_gpt("optim_grads")
    b, opt_b = shard_gpt("optim_grads")
    eval_gathers = []
    for x in data:
        xs = local_slice(x, rank, world)
        with torch.no_grad():
            b(xs[:, :-1])  # b's weights are current from here
        lm_loss(a(xs[:, :-1]), xs[:, 1:]).backward()
        opt_a.step()
        opt_a.zero_grad()
        # Only a's weights changed: b's forward needs no gather.
        flatfsdp.comm_account().reset()
        with torch.no_grad():
            b(xs[:, :-1])
        eval_gathers.append(flatfsdp.comm_account().snapshot().get("all_gather", {}).get("count", 0))
        lm_loss(b(xs[:, :-1]), xs[:, 1:]).backward()
        opt_b.step()
        opt_b.zero_grad()
    return eval_gathers, max_diff(full_params(a), full_params(b))


def test_two_sharded_models_do_not_interfere():
    for eval_gathers, distance in run_ranks(two_models_worker, 2):
        # Before: a's step bumped a process-wide epoch, and b re-gathered too.
        assert eval_gathers == [0, 0, 0], eval_gathers
        assert distance == 0.0  # same data, same steps: the same model
