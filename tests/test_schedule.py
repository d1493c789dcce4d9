"""The schedule: prefetch order, recompute without extra gathers, units kept
gathered, and robustness to evaluation, changing order and repeated forwards."""

from __future__ import annotations

import dataclasses
import resource

import pytest
import torch
from torch import nn

import flatfsdp
from flatfsdp.models.gpt import GPT, TransformerBlock, lm_loss
from harness import run_ranks
from training import (CFG, batches, full_params, global_mean, local_slice, make_optimizer, max_diff,
                      train_reference, train_with_account)


def _sharded(cfg=CFG, **kwargs):
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = make_optimizer("sgd", model.named_parameters())
    return flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[TransformerBlock], **kwargs)


def recompute_and_keeping(rank, world):
    data = batches(4)
    ref_losses, ref_params = train_reference(4, "sgd", data=data)
    out = {}
    for mode in ("none", "reentrant", "non_reentrant"):
        model, opt = _sharded(dataclasses.replace(CFG, recompute=mode))
        losses, comm = train_with_account(model, opt, rank, world, data)
        out[mode] = (max(abs(a - b) for a, b in zip(losses, ref_losses)),
                     max_diff(full_params(model), ref_params), comm)
    for keep in (True, False):
        model, opt = _sharded(reshard_after_forward=keep)
        losses, comm = train_with_account(model, opt, rank, world, data)
        out[f"reshard={keep}"] = (max(abs(a - b) for a, b in zip(losses, ref_losses)), 0.0, comm)
    out["numel"] = sum(p.numel() for p in model.parameters())
    out["root_numel"] = sum(p.numel() for g in model._flatfsdp_state.groups for p in g.params)
    out["last_numel"] = sum(p.numel() for p in model.blocks[-1].parameters())
    return out


def prefetch_order(rank, world):
    """What is already gathered when each block starts computing, forward and backward."""
    cfg = dataclasses.replace(CFG, n_layer=4)
    out = {}
    for limit in (None, 10**9):
        model, opt = _sharded(cfg, prefetch_bytes=limit)
        blocks = list(model.blocks)
        seen_forward, seen_backward = [], []

        def on_forward(index):
            def hook(module, args):
                seen_forward.append((index, [b._flatfsdp_state.is_gathered for b in blocks]))
                args[0].register_hook(lambda g: seen_backward.append(
                    (index, [b._flatfsdp_state.is_gathered for b in blocks])))
            return hook
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(on_forward(i))
        for step, x in enumerate(batches(2)):
            seen_forward.clear()
            seen_backward.clear()
            x = local_slice(x, rank, world)
            lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
        out[limit] = (list(seen_forward), list(seen_backward))
    return out


class _SkippingGPT(GPT):
    """Runs only the blocks listed in ``self.active``: the order changes between steps."""

    active: tuple[int, ...] = (0, 1)

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
        for i in self.active:
            x = self.blocks[i](x)
        return self.lm_head(self.ln_f(x))


def robustness(rank, world):
    """100 steps; every 10th an evaluation (no_grad or inference_mode), a skipped
    block, or two forwards before one backward. Nothing may hang, drift or leak."""
    torch.manual_seed(0)
    model = _SkippingGPT(CFG)
    opt = make_optimizer("adamw", model.named_parameters())
    model, opt = flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[TransformerBlock])
    torch.manual_seed(0)
    ref = _SkippingGPT(CFG)
    ref_opt = make_optimizer("adamw", ref.named_parameters())
    data = batches(100, seed=7)
    at_rest, rss, worst, evals = set(), [], 0.0, []
    for step, x in enumerate(data):
        active = (1,) if step % 10 == 3 else (0, 1)
        model.active = ref.active = active
        lx = local_slice(x, rank, world)
        if step % 10 == 5:  # two forwards, one backward
            loss = (lm_loss(model(lx[:, :-1]), lx[:, 1:]) + lm_loss(model(lx[:, :-1]), lx[:, 1:])) / 2
            ref_loss = (lm_loss(ref(x[:, :-1]), x[:, 1:]) + lm_loss(ref(x[:, :-1]), x[:, 1:])) / 2
        else:
            loss = lm_loss(model(lx[:, :-1]), lx[:, 1:])
            ref_loss = lm_loss(ref(x[:, :-1]), x[:, 1:])
        loss.backward()
        ref_loss.backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        worst = max(worst, abs(global_mean(loss) - ref_loss.item()))
        if step % 10 == 9:
            mode = torch.no_grad if step % 20 == 9 else torch.inference_mode
            with mode():
                evals.append((global_mean(lm_loss(model(lx[:, :-1]), lx[:, 1:])),
                              lm_loss(ref(x[:, :-1]), x[:, 1:]).item()))
        at_rest.add(flatfsdp.allocated_buffer_bytes(model))
        rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    gathered = [m for m in model.modules() if isinstance(m, flatfsdp.FSDPModule) and m._flatfsdp_state.is_gathered]
    grad_share = sum(g.buffers.main_grad.numel() * 4 for m in model.modules() if isinstance(m, flatfsdp.FSDPModule)
                     for g in m._flatfsdp_state.groups if g.trainable)
    return {"worst": worst, "at_rest": at_rest, "persistent": flatfsdp.persistent_buffer_bytes(model),
            "grad_share": grad_share,
            "rss_growth_kb": rss[-1] - rss[10], "gathered_at_rest": len(gathered), "evals": evals}


def schedule_worker(rank, world):
    return {"recompute": recompute_and_keeping(rank, world), "prefetch": prefetch_order(rank, world),
            "robust": robustness(rank, world)}


@pytest.fixture(scope="module")
def results():
    return run_ranks(schedule_worker, 2)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_recompute_moves_no_extra_bytes_and_trains_alike(results, mode):
    out = results[0]["recompute"]
    loss_diff, param_diff, comm = out[mode]
    assert comm == out["none"][2], (mode, comm, out["none"][2])
    assert loss_diff < 1e-5 and param_diff < 1e-5


def test_units_kept_gathered_skip_their_backward_gather(results):
    out = results[0]["recompute"]
    numel, kept_default = out["numel"], out["root_numel"] + out["last_numel"]
    gathered = {k: out[k][2]["all_gather"]["bytes"] // 4 for k in ("reshard=True", "none", "reshard=False")}
    # True as FSDP2 reads it: every unit, the root too, is released and gathered again.
    assert gathered == {"reshard=True": 2 * numel,
                        "none": 2 * numel - kept_default,               # default: the root and the last block stay
                        "reshard=False": numel}                         # every unit gathered once
    assert all(out[k][0] < 1e-5 for k in ("reshard=True", "reshard=False"))


@pytest.mark.parametrize("limit", [None, 10**9])
def test_next_units_are_gathering_before_the_current_one_computes(results, limit):
    forward, backward = results[0]["prefetch"][limit]
    for index, gathered in forward:
        ahead = gathered[index + 1:]
        if limit is None:
            assert ahead[:1] in ([], [True]), (index, gathered)  # the next block is on its way
            assert not any(ahead[1:]), (index, gathered)          # one ahead, not more
        else:
            assert all(ahead), (index, gathered)                   # a big budget prefetches all
    for index, gathered in backward:
        if index > 0:
            assert gathered[index - 1], (index, gathered)          # backward prefetches in reverse


def test_evaluation_changing_order_and_repeated_forwards_stay_correct_and_leak_free(results):
    for out in (r["robust"] for r in results):
        assert out["worst"] < 1e-4, out["worst"]
        # Between steps the buffers hold the persistent share, less the ZeRO-3
        # main grads released once a forward has seen the optimizer drop them
        # (all of them after an evaluation; a skipped block's after its step):
        # never more, and no more than those grads less.
        assert max(out["at_rest"]) == out["persistent"], out["at_rest"]
        assert min(out["at_rest"]) == out["persistent"] - out["grad_share"], out["at_rest"]
        assert out["gathered_at_rest"] == 0
        assert out["rss_growth_kb"] < 20_000, out["rss_growth_kb"]
        assert len(out["evals"]) == 10
        for ours, ref in out["evals"]:
            assert abs(ours - ref) < 1e-4, out["evals"]
