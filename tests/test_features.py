"""Training-loop features against an unsharded reference (2 real ranks):
gradient accumulation, frozen and unused parameters, tied weights, clipping,
a unit called twice, nested units, and the FSDP2-style API against FSDP2."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flatfsdp
from flatfsdp.models.gpt import MLP, TransformerBlock, lm_loss
from harness import run_ranks
from training import (batches, full_params, global_mean, local_slice, make_model, make_optimizer, max_diff,
                      shard_gpt)

STEPS = 6


def _reference_step(model, opt, xs, clip=None):
    """One optimizer step over microbatches ``xs`` (global batches), loss averaged."""
    total = 0.0
    for x in xs:
        loss = lm_loss(model(x[:, :-1]), x[:, 1:]) / len(xs)
        loss.backward()
        total += loss.item()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item() if clip else None
    opt.step()
    opt.zero_grad()
    return total, norm


def _sharded_step(model, opt, xs, rank, world, no_sync=False, clip=None):
    total = 0.0
    for i, x in enumerate(xs):
        x = local_slice(x, rank, world)
        model.set_requires_gradient_sync(not no_sync or i == len(xs) - 1)
        loss = lm_loss(model(x[:, :-1]), x[:, 1:]) / len(xs)
        loss.backward()
        total += global_mean(loss)
    norm = None
    if clip:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        norm = norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item()
    opt.step()
    opt.zero_grad()
    return total, norm


def _compare(build_ref, build_sharded, rank, world, micro=1, no_sync=False, clip=None, opt_name="sgd"):
    """Train both for STEPS steps; return (max loss diff, max param diff, norms)."""
    data = batches(STEPS * micro, seed=3)
    ref = build_ref()
    ref_opt = make_optimizer(opt_name, ref.named_parameters())
    model, opt = build_sharded(opt_name)
    loss_diff, norms = 0.0, []
    for step in range(STEPS):
        xs = data[step * micro:(step + 1) * micro]
        ref_loss, ref_norm = _reference_step(ref, ref_opt, xs, clip)
        loss, norm = _sharded_step(model, opt, xs, rank, world, no_sync, clip)
        loss_diff = max(loss_diff, abs(loss - ref_loss))
        norms.append((ref_norm, norm))
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return loss_diff, max_diff(full_params(model), ref_params), norms


def accumulation(rank, world):
    out = {}
    for strategy in ("no_shard", "optim", "optim_grads_params"):
        for no_sync in (False, True):
            out[(strategy, no_sync)] = _compare(
                make_model, lambda o, s=strategy: shard_gpt(s, opt_name=o), rank, world, micro=4, no_sync=no_sync)
    return out


def clipping(rank, world):
    return {s: _compare(make_model, lambda o, s=s: shard_gpt(s, opt_name=o), rank, world, clip=0.05)
            for s in ("optim_grads", "optim_grads_params")}


def _frozen(model):
    model.pos_emb.weight.requires_grad_(False)
    model.blocks[0].ln1.weight.requires_grad_(False)
    return model


def frozen(rank, world):
    def sharded(opt_name):
        model = _frozen(make_model())
        opt = make_optimizer(opt_name, [(n, p) for n, p in model.named_parameters() if p.requires_grad])
        return flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[TransformerBlock])
    result = _compare(lambda: _frozen(make_model()), sharded, rank, world, opt_name="adamw")
    model, _ = sharded("adamw")
    frozen_grads = [p.grad for n, p in model.named_parameters() if not p.requires_grad]
    return result, len(frozen_grads), all(g is None for g in frozen_grads)


class _GPTWithExtras(nn.Module):
    """A GPT whose first block runs twice and which holds a never-used layer."""

    def __init__(self):
        super().__init__()
        self.gpt = make_model()
        self.gpt.blocks[1].unused = nn.Linear(32, 32)

    def forward(self, idx):
        gpt = self.gpt
        x = gpt.tok_emb(idx) + gpt.pos_emb(torch.arange(idx.shape[1]))
        x = gpt.blocks[0](gpt.blocks[0](x))
        x = gpt.blocks[1](x)
        return gpt.lm_head(gpt.ln_f(x))


def extras(rank, world):
    def sharded(opt_name):
        model = _GPTWithExtras()
        opt = make_optimizer(opt_name, model.named_parameters())
        return flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[TransformerBlock])
    result = _compare(_GPTWithExtras, sharded, rank, world)
    model, opt = sharded("sgd")
    x = local_slice(batches(1)[0], rank, world)
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    unused = model.gpt.blocks[1].unused
    return result, unused.weight.grad is None, model.gpt.blocks[0].ln1.weight.grad is not None


def nested_and_tied_units(rank, world):
    def sharded(opt_name, units):
        model = make_model()
        opt = make_optimizer(opt_name, model.named_parameters())
        return flatfsdp.fully_shard(model, opt, fsdp_unit_modules=units)
    return {
        "nested": _compare(make_model, lambda o: sharded(o, [TransformerBlock, MLP]), rank, world),
        # The embedding is a unit, but its weight is tied to lm_head outside it: the root must own it.
        "tied": _compare(make_model, lambda o: sharded(o, [TransformerBlock, nn.Embedding]), rank, world),
    }


def _fsdp2_style(fully_shard, policy):
    model = make_model()
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, make_optimizer("adamw", model.named_parameters())


def against_fsdp2(rank, world):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    out = {}
    for name, policy in (("fp32", MixedPrecisionPolicy()),
                         ("bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))):
        losses = {}
        for impl, fn in (("flatfsdp", flatfsdp.fully_shard), ("torch", torch_fully_shard)):
            model, opt = _fsdp2_style(fn, policy)
            run = []
            for x in batches(STEPS, seed=5):
                x = local_slice(x, rank, world)
                loss = lm_loss(model(x[:, :-1]), x[:, 1:])
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor().item()
                opt.step()
                opt.zero_grad()
                run.append((global_mean(loss), norm))
            losses[impl] = run
        out[name] = losses
    return out


def api_details(rank, world):
    """String unit paths, a named mesh dimension, bf16 reduction, summed
    gradients, deferred gradient sync, Adam, and what wrapping leaves alone."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    out = {}

    def by_path(opt_name, **kw):
        model = make_model()
        opt = make_optimizer(opt_name, model.named_parameters())
        return flatfsdp.fully_shard(model, opt, device_mesh=mesh, dp_shard_dim="dp",
                                    fsdp_unit_modules=["flatfsdp.models.gpt.TransformerBlock"], **kw)
    out["string_path_and_mesh_dim"] = _compare(make_model, by_path, rank, world)
    out["deferred_sync"] = _compare(make_model, lambda o: by_path(o, sync_model_each_microbatch=False),
                                    rank, world, micro=2)
    out["adam"] = _compare(make_model, lambda o: by_path(o), rank, world, opt_name="adam")
    policy = flatfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    out["bf16_reduce"] = _compare(make_model, lambda o: by_path(o, mixed_precision_policy=policy), rank, world,
                                  opt_name="adamw")
    # Wrapping keeps param groups and hyperparameters, and steps nothing.
    model = make_model()
    opt = make_optimizer("adamw", model.named_parameters())
    before = [(len(g["params"]), g["weight_decay"], g["lr"]) for g in opt.param_groups]
    model, opt = flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[TransformerBlock])
    out["groups"] = (before, [(len(g["params"]), g["weight_decay"], g["lr"]) for g in opt.param_groups],
                     len(opt.state), all(isinstance(p, torch.distributed.tensor.DTensor)
                                         for g in opt.param_groups for p in g["params"]))
    # Per-token loss: gradients are summed over ranks, not averaged.
    norms = []
    for per_token in (False, True):
        model, _ = shard_gpt("optim_grads_params", calculate_per_token_loss=per_token)
        x = local_slice(batches(1)[0], rank, world)
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor().item())
    out["per_token_norm_ratio"] = norms[1] / norms[0]
    return out


def feature_worker(rank, world):
    return {"api": api_details(rank, world), "accumulation": accumulation(rank, world), "clipping": clipping(rank, world),
            "frozen": frozen(rank, world), "extras": extras(rank, world),
            "units": nested_and_tied_units(rank, world), "fsdp2": against_fsdp2(rank, world)}


@pytest.fixture(scope="module")
def results():
    return run_ranks(feature_worker, 2)[0]


@pytest.mark.parametrize("no_sync", [False, True])
@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads_params"])
def test_gradient_accumulation_over_four_microbatches(results, strategy, no_sync):
    loss_diff, param_diff, _ = results["accumulation"][(strategy, no_sync)]
    assert loss_diff < 1e-5 and param_diff < 1e-5, (loss_diff, param_diff)


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_clip_grad_norm_returns_global_norm_and_clips_alike(results, strategy):
    loss_diff, param_diff, norms = results["clipping"][strategy]
    for ref_norm, norm in norms:
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm
    assert any(ref > 0.05 for ref, _ in norms), "clipping never engaged; the test would prove nothing"
    assert loss_diff < 1e-5 and param_diff < 1e-5


def test_frozen_parameters_train_like_reference_and_get_no_grad(results):
    (loss_diff, param_diff, _), n_frozen, none_grads = results["frozen"]
    assert loss_diff < 1e-5 and param_diff < 1e-4
    assert n_frozen == 2 and none_grads


def test_unit_called_twice_and_unused_parameter(results):
    (loss_diff, param_diff, _), unused_has_no_grad, used_has_grad = results["extras"]
    assert loss_diff < 1e-5 and param_diff < 1e-5
    assert unused_has_no_grad and used_has_grad


@pytest.mark.parametrize("case", ["nested", "tied"])
def test_nested_units_and_tied_weight_across_units(results, case):
    loss_diff, param_diff, _ = results["units"][case]
    assert loss_diff < 1e-5 and param_diff < 1e-5


def test_fsdp2_script_gives_fsdp2_losses_after_changing_the_import(results):
    # Gradient norms differ in round-off only (summation order), which Adam
    # turns into slightly different weights: 1e-4 on norms, 1e-5 on losses.
    for name, loss_tol, norm_tol in (("fp32", 1e-5, 1e-4), ("bf16", 2e-2, 5e-2)):
        ours, theirs = results["fsdp2"][name]["flatfsdp"], results["fsdp2"][name]["torch"]
        for (loss, norm), (ref_loss, ref_norm) in zip(ours, theirs):
            assert abs(loss - ref_loss) <= loss_tol * ref_loss, (name, ours, theirs)
            assert abs(norm - ref_norm) <= norm_tol * ref_norm, (name, ours, theirs)


@pytest.mark.parametrize("case", ["string_path_and_mesh_dim", "deferred_sync", "adam"])
def test_api_variants_train_like_reference(results, case):
    loss_diff, param_diff, _ = results["api"][case]
    assert loss_diff < 1e-5 and param_diff < (1e-5 if case != "adam" else 0.05), (case, loss_diff, param_diff)


def test_bf16_gradient_reduction_trains_within_bf16_tolerance(results):
    loss_diff, _, _ = results["api"]["bf16_reduce"]
    assert loss_diff < 0.05


def test_wrapping_keeps_param_groups_and_steps_nothing(results):
    before, after, n_state, all_dtensors = results["api"]["groups"]
    assert before == after and n_state == 0 and all_dtensors


def test_calculate_per_token_loss_sums_gradients_over_ranks(results):
    assert abs(results["api"]["per_token_norm_ratio"] - 2.0) < 1e-5
