"""The root does not stall the link (issue 46, outcome 1): an untied GPT's token
table and output head are sharding units of their own. The head, last in
forward, is gathered while the blocks run and its gradient reduced first in
backward; the token table's last; the root keeps only the position table and
the final norm. Same arithmetic as one root lump: the same losses, bit for bit,
and the same bytes. A tied table and head are one unit of two modules (one
parameter, one unit); with row lookups its forward fetches the ids' rows, the
whole table travels for the head while the blocks run, and the head's
gradient is reduced first, dense, the lookup's rows last.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import flatfsdp
from flatfsdp.bench.workload import embedding_units, schedule_embedding_units, unit_classes
from flatfsdp.models.gpt import GPT, TransformerBlock
from harness import run_ranks
from training import CFG, batches, full_params, global_mean, local_slice, make_optimizer, max_diff

STEPS = 3
STRATEGIES = ("optim_grads_params", "optim_grads", "optim")
"""ZeRO-3, -2, -1: the units are ordinary units under each."""


def _model(tied: bool) -> GPT:
    torch.manual_seed(0)
    return GPT(dataclasses.replace(CFG, tie_embeddings=tied))


def _reference(tied: bool, data: list) -> tuple[list, dict]:
    """Unsharded, on the global batch, the loss the bench trains (model(x, targets))."""
    model = _model(tied)
    opt = make_optimizer("adamw", model.named_parameters())
    losses = []
    for x in data:
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _one_call(tied: bool, split: bool | str, strategy: str):
    """``split``: False (the root lump), True (embedding units) or "rows"
    (embedding units, the token table's forward gathering only its rows)."""
    model = _model(tied)
    opt = make_optimizer("adamw", model.named_parameters())
    units = unit_classes(model, tied_unit=True) if split else [TransformerBlock]
    model, opt = flatfsdp.fully_shard(model, opt, fsdp_unit_modules=units, zero_dp_strategy=strategy)
    if split:
        schedule_embedding_units(model, rows_only=split == "rows")
    return model, opt


def _per_module(tied: bool, split: bool | str, strategy: str):
    model = _model(tied)
    for unit in list(model.blocks) + (embedding_units(model, tied_unit=True) if split else []):
        flatfsdp.fully_shard(unit)
    flatfsdp.fully_shard(model)
    if split:
        schedule_embedding_units(model, rows_only=split == "rows")
    return model, make_optimizer("adamw", model.named_parameters())


def _train(model, opt, rank: int, world: int, data: list) -> dict:
    """Losses, and for the last step: its communication account, the unit
    collectives in issue order, and whether the head was gathered when the
    last block began its forward."""
    state = model._flatfsdp_state
    seen = {}
    model.blocks[-1].register_forward_pre_hook(
        lambda m, args: seen.__setitem__("head_gathered", model.lm_head._flatfsdp_state.is_gathered
                                         if "_flatfsdp_state" in model.lm_head.__dict__ else None))
    losses = []
    for x in data:
        flatfsdp.comm_account().reset()
        x = local_slice(x, rank, world)
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        events = state.context.schedule.recorded()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
    root_numel = sum(p.numel() for g in state.groups for p in g.params)
    return dict(losses=losses, comm=flatfsdp.comm_account().snapshot(), events=events,
                head_gathered=seen["head_gathered"], root_numel=root_numel, params=full_params(model))


def split_worker(rank, world):
    os.environ["FLATFSDP_CHECK_SCHEDULE"] = "1"  # records the unit collectives' order
    out = {}
    for tied in (False, True):
        data = batches(STEPS)
        ref_losses, ref_params = _reference(tied, data)
        out["reference", tied] = ref_losses
        runs = [("one_call", split, tied, s) for split in (False, True) for s in STRATEGIES]
        runs.append(("per_module", True, tied, "optim_grads_params"))
        runs += [(door, "rows", tied, "optim_grads_params") for door in ("one_call", "per_module")]
        for door, split, _, strategy in runs:
            build = _one_call if door == "one_call" else _per_module
            result = _train(*build(tied, split, strategy), rank, world, data)
            result["param_diff"] = max_diff(result.pop("params"), ref_params)
            out[door, split, tied, strategy] = result
    out["numel"] = {n: p.numel() for n, p in _model(False).named_parameters()}
    out["last_ids"] = local_slice(batches(STEPS)[-1], rank, world)[:, :-1]
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(split_worker, 2)


def _reductions(events) -> list[str]:
    return [e.split("'")[1] for e in events if e.startswith("the gradient reduction")]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("door", ["one_call", "per_module"])
def test_losses_match_the_unsharded_reference_and_the_root_lump(results, tied, door):
    lump = results[0]["one_call", False, tied, "optim_grads_params"]
    for strategy in (STRATEGIES if door == "one_call" else ("optim_grads_params",)):
        split = results[0][door, True, tied, strategy]
        ref = results[0]["reference", tied]
        assert max(abs(a - b) for a, b in zip(split["losses"], ref)) < 1e-5
        assert split["param_diff"] < 1e-5
        # Each element is summed over the same two ranks in either layout: exact.
        assert split["losses"] == results[0]["one_call", False, tied, strategy]["losses"]
    assert lump["losses"] == results[0][door, True, tied, "optim_grads_params"]["losses"]


@pytest.mark.parametrize("door", ["one_call", "per_module"])
def test_untied_head_is_reduced_first_and_token_table_last(results, door):
    for rank in results:
        events = rank[door, True, False, "optim_grads_params"]["events"]
        reductions = _reductions(events)
        assert reductions[0] == "lm_head", reductions
        assert reductions[-2:] == ["tok_emb", "<root>"], reductions
        assert all(r.startswith("blocks.") for r in reductions[1:-2]), reductions
        gathers = [e.split("'")[1] for e in events if e.startswith("the forward gather")]
        assert gathers == ["<root>", "tok_emb", "blocks.0", "blocks.1", "lm_head"], gathers


@pytest.mark.parametrize("door", ["one_call", "per_module"])
def test_untied_head_is_gathered_before_the_last_block_runs(results, door):
    for rank in results:
        assert rank[door, True, False, "optim_grads_params"]["head_gathered"] is True


def test_root_keeps_only_the_position_table_and_final_norm(results):
    numel = results[0]["numel"]
    small = numel["pos_emb.weight"] + numel["ln_f.weight"] + numel["ln_f.bias"]
    big = numel["tok_emb.weight"] + numel["lm_head.weight"]
    for door in ("one_call", "per_module"):
        assert results[0][door, True, False, "optim_grads_params"]["root_numel"] == small
        # Tied: one parameter, held by the unit of the table and the head.
        assert results[0][door, True, True, "optim_grads_params"]["root_numel"] == small
    assert results[0]["one_call", False, False, "optim_grads_params"]["root_numel"] == small + big


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_split_moves_the_same_bytes_as_the_root_lump(results, strategy):
    for rank in results:
        lump, split = (rank["one_call", s, False, strategy]["comm"] for s in (False, True))
        assert {k: v["bytes"] for k, v in split.items()} == {k: v["bytes"] for k, v in lump.items()}
        assert sum(v["count"] for v in split.values()) > sum(v["count"] for v in lump.values())


def _options(name: str) -> dict:
    if name == "hsdp":  # two replicas of one shard: the outer all-reduce path
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp_outer", "dp_shard"))
        return dict(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                    outer_dp_sharding_strategy="no_shard")
    if name == "int8":
        return dict(param_gather_dtype="int8")
    from torch.distributed.fsdp import CPUOffloadPolicy
    return dict(offload_policy=CPUOffloadPolicy())


def _step_losses(model, opt, rank: int, world: int) -> list[float]:
    """One step per batch of the shared data; the global mean loss of each."""
    losses = []
    for x in batches(STEPS):
        x = local_slice(x, rank, world)
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
    return losses


def other_paths_worker(rank, world):
    out = {}
    for name in ("hsdp", "int8", "offload"):
        # Row lookups need plainly gathered weights: int8 codes keep the table's gather.
        for split in (False, True) + (() if name == "int8" else ("rows",)):
            model = _model(False)
            opt = make_optimizer("adamw", model.named_parameters())
            units = unit_classes(model) if split else [TransformerBlock]
            model, opt = flatfsdp.fully_shard(model, opt, fsdp_unit_modules=units, **_options(name))
            if split:
                schedule_embedding_units(model, rows_only=split == "rows")
            losses = _step_losses(model, opt, rank, world)
            out[name, split] = losses, full_params(model)
    return out


def test_split_matches_the_lump_under_hsdp_int8_gathers_and_offload():
    """The embedding units are ordinary units: whatever path the root lump
    took (HSDP's outer all-reduce, block-scaled int8 gathers, main weights in
    host memory), the split takes it too, with the same numbers; so do row
    lookups, where the weights are gathered plainly."""
    out = run_ranks(other_paths_worker, 2)[0]
    for (name, split), (losses, params) in out.items():
        lump_losses, lump_params = out[name, False]
        assert losses == lump_losses, (name, split)
        assert max_diff(params, lump_params) == 0.0, (name, split)
    assert ("hsdp", "rows") in out and ("offload", "rows") in out


@pytest.mark.parametrize("door", ["one_call", "per_module"])
def test_token_lookup_gathers_and_reduces_only_the_rows_of_the_batch(results, door):
    """set_lookup_rows_only: the token table's forward moves the rows the two
    ranks' ids touch (an all-reduce of those rows, and the ids), not the
    table; the backward does not gather it either; its gradient reduction
    sends those rows, not the table; the numbers are the lump's, bit for bit."""
    numel, lump = results[0]["numel"], results[0]["one_call", False, False, "optim_grads_params"]
    distinct = torch.cat([r["last_ids"].reshape(-1) for r in results]).unique().numel()
    width = CFG.d_model
    assert 0 < distinct < CFG.vocab_size  # the check below would not tell rows from table otherwise
    for rank in results:
        rows = rank[door, "rows", False, "optim_grads_params"]
        assert rows["losses"] == lump["losses"] and rows["param_diff"] < 1e-5
        comm = rows["comm"]
        assert comm["lookup_rows"] == {"count": 1, "bytes": distinct * width * 4}
        assert comm["all_gather"]["bytes"] == lump["comm"]["all_gather"]["bytes"] - numel["tok_emb.weight"] * 4
        # Its gradient: the same rows, summed (two ranks: the same two numbers added), the rest zeros.
        assert comm["reduce_rows"] == {"count": 1, "bytes": distinct * width * 4}
        assert comm["reduce_scatter"]["bytes"] == (lump["comm"]["reduce_scatter"]["bytes"]
                                                   - numel["tok_emb.weight"] * 4)
        assert _reductions(rows["events"])[0] == "lm_head"


@pytest.mark.parametrize("door", ["one_call", "per_module"])
def test_tied_table_looks_up_rows_and_reduces_the_head_first(results, door):
    """A tied table and head, one unit, with row lookups: the lookup fetches
    the ids' rows; the whole table is gathered once, for the head, on its way
    before the last block runs; the weight's gradient is reduced twice -- the
    head's, dense, first of all, the lookup's rows last before the root. A
    reduction is linear, so the two sum to the lump's gradient (in another
    order: close, not bit for bit)."""
    numel, lump = results[0]["numel"], results[0]["one_call", False, True, "optim_grads_params"]
    distinct = torch.cat([r["last_ids"].reshape(-1) for r in results]).unique().numel()
    width = CFG.d_model
    assert 0 < distinct < CFG.vocab_size
    for rank in results:
        rows = rank[door, "rows", True, "optim_grads_params"]
        assert max(abs(a - b) for a, b in zip(rows["losses"], lump["losses"])) < 1e-5
        assert rows["param_diff"] < 1e-5
        comm = rows["comm"]
        assert comm["lookup_rows"] == {"count": 1, "bytes": distinct * width * 4}
        assert comm["reduce_rows"] == {"count": 1, "bytes": distinct * width * 4}
        # The table whole once (for the head), its dense gradient once (the head's): the lump's bytes, plus the rows.
        assert comm["all_gather"]["bytes"] == lump["comm"]["all_gather"]["bytes"]
        assert comm["reduce_scatter"]["bytes"] == lump["comm"]["reduce_scatter"]["bytes"]
        assert numel["tok_emb.weight"] * 4 <= comm["reduce_scatter"]["bytes"]
        reductions = _reductions(rows["events"])
        assert reductions[0] == "tok_emb, lm_head", reductions
        assert reductions[-2:] == ["tok_emb, lm_head", "<root>"], reductions
        assert all(r.startswith("blocks.") for r in reductions[1:-2]), reductions
        assert rows["head_gathered"] is True


def head_first_worker(rank, world):
    """Four blocks, a tied unit with row lookups: the schedule of the second step."""
    os.environ["FLATFSDP_CHECK_SCHEDULE"] = "1"
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CFG, tie_embeddings=True, n_layer=4))
    for unit in list(model.blocks) + embedding_units(model, tied_unit=True):
        flatfsdp.fully_shard(unit)
    flatfsdp.fully_shard(model)
    schedule_embedding_units(model, rows_only=True)
    opt = make_optimizer("adamw", model.named_parameters())
    for x in batches(2):
        x = local_slice(x, rank, world)
        with torch.no_grad():  # an eval forward between steps: rows, then the whole table, no faces
            evaluated = model(x[:, :-1], x[:, 1:])
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        events = model._flatfsdp_state.context.schedule.recorded()
        opt.step()
        opt.zero_grad()
        assert torch.equal(evaluated, loss.detach()), (evaluated, loss)
    assert model.lm_head.weight is model.tok_emb.weight  # released: one parameter again
    return events


def test_tied_head_reduction_goes_behind_the_first_backward_gathers():
    """The head's whole gradient, first in backward, would sit on the link in
    front of the gathers the next blocks' backward needs: those are issued
    first (the last block stayed gathered from forward)."""
    for events in run_ranks(head_first_worker, 2):
        first = next(i for i, e in enumerate(events) if e.startswith("the gradient reduction"))
        assert events[first] == "the gradient reduction of unit 'tok_emb, lm_head'", events
        before = [e for e in events[:first] if e.startswith("the backward gather")]
        assert before == ["the backward gather of unit 'blocks.2'", "the backward gather of unit 'blocks.1'"], events


def paced_worker(rank, world):
    """The tied table's whole gather, paced: one slice posted per pump, the
    rest on wait, the table whole and exact at the end."""
    model, opt = _per_module(True, "rows", "optim_grads_params")
    x = local_slice(batches(1)[0], rank, world)
    model(x[:, :-1], x[:, 1:]).backward()  # everything initialised, the table's shard current
    opt.step()
    whole = full_params(model)["tok_emb.weight"]
    state = model.tok_emb._flatfsdp_state
    group = state.groups[0]
    state.unshard()
    state.wait_unshard()
    state.reshard()
    group.gather_rows(x[:, :-1])
    group.forget_rows()
    paced = group.gather_paced(4, "test")
    table = group.params[0]
    posted = [paced.posted_all]
    for _ in range(3):
        paced.pump()
        posted.append(paced.posted_all)
    paced.wait()
    return dict(posted=posted, exact=torch.equal(table.detach(), whole), all_posted=paced.posted_all)


def test_paced_gather_posts_a_slice_per_pump_and_lands_the_whole_table():
    for out in run_ranks(paced_worker, 2):
        assert out["posted"] == [False, False, False, False]  # 4 slices: 3 pumps leave one
        assert out["all_posted"] and out["exact"]


def refusal_worker(rank, world):
    out = {}
    model = _model(False)
    flatfsdp.fully_shard(model.blocks[0])
    flatfsdp.fully_shard(model.tok_emb, zero_dp_strategy="optim")
    flatfsdp.fully_shard(model)
    for name, unit in (("block", model.blocks[0]), ("zero1", model.tok_emb)):
        try:
            unit.set_lookup_rows_only(True)
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    return out


def test_lookup_rows_only_refuses_what_it_cannot_serve():
    out = run_ranks(refusal_worker, 2)[0]
    assert "unit 'blocks.0' cannot gather rows only: it holds 0 nn.Embedding modules, not one" in out["block"]
    assert "unit 'tok_emb' cannot gather rows only" in out["zero1"] and "ZeRO-3" in out["zero1"]


def hybrid_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    out = {}
    for tied in (False, True):
        for outer in ("no_shard", "optim"):  # HSDP, HFSDP over 2 x 2 ranks
            for split in (False, "rows"):
                model = _model(tied)
                opt = make_optimizer("adamw", model.named_parameters())
                units = unit_classes(model, tied_unit=True) if split else [TransformerBlock]
                mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
                model, opt = flatfsdp.fully_shard(model, opt, fsdp_unit_modules=units, device_mesh=mesh,
                                                  dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                                                  outer_dp_sharding_strategy=outer)
                if split:
                    schedule_embedding_units(model, rows_only=True)
                flatfsdp.comm_account().reset()
                losses = _step_losses(model, opt, rank, world)
                out[tied, outer, split] = losses, flatfsdp.comm_account().snapshot()
    return out


def test_row_lookups_under_hsdp_and_hfsdp_at_four_ranks():
    """Rows are looked up within each replica's shard group; HFSDP's outer
    gather brings the shard up to date first. Untied: the lump's losses,
    exactly; tied (the head's gradient and the lookup's rows reduced apart):
    close. Under HSDP a row reduction's sum across replicas sends only rows
    too: the outer all-reduce carries the table's shard once (the head's
    gradient), not twice."""
    out = run_ranks(hybrid_worker, 4)[0]
    for outer in ("no_shard", "optim"):
        assert out[False, outer, "rows"][0] == out[False, outer, False][0], outer
        tied, lump = out[True, outer, "rows"][0], out[True, outer, False][0]
        assert max(abs(a - b) for a, b in zip(tied, lump)) < 1e-5, outer
    table = CFG.vocab_size * CFG.d_model * 4 // 2  # a shard of the table, fp32 (counted over the STEPS steps)
    for tied in (False, True):
        split, lump = out[tied, "no_shard", "rows"][1], out[tied, "no_shard", False][1]
        # Untied: the table's outer share is its rows only; tied: the head's dense share stays, the rows add.
        expected = lump["all_reduce"]["bytes"] - (STEPS * table if not tied else 0)
        assert split["all_reduce"]["bytes"] == expected, (tied, split, lump)
        assert split["reduce_rows"]["count"] == 2 * STEPS  # inner and across replicas, each step


def accumulation_worker(rank, world):
    """Two microbatches a step, the first without gradient sync: the rows the
    reduction sends must cover both microbatches' lookups."""
    out = {}
    for split in (False, "rows"):
        model, opt = _per_module(False, split, "optim_grads_params")
        losses = []
        for x in batches(STEPS):
            x = local_slice(x, rank, world)
            for micro, sync in ((x[:1], False), (x[1:], True)):
                model.set_requires_gradient_sync(sync)
                loss = model(micro[:, :-1], micro[:, 1:])
                loss.backward()
                losses.append(global_mean(loss))
            opt.step()
            opt.zero_grad()
        out[split] = losses, full_params(model)
    return out


def test_row_reduction_covers_every_microbatch_since_the_last():
    out = run_ranks(accumulation_worker, 2)[0]
    assert out["rows"][0] == out[False][0]
    assert max_diff(out["rows"][1], out[False][1]) == 0.0
