"""Megatron-LM's ``fsdp_dtensor`` checkpoints of a flatfsdp.megatron_fsdp model,
without Megatron-Core: what its save and load do, by hand, on a model with a
fused weight, across world sizes and into HSDP and HFSDP layouts.

What Megatron-LM does (megatron/training/checkpointing.py with
Megatron-Core's fsdp_dtensor_checkpoint.py and DistributedOptimizer):
the model's state dict and the optimizer's state keyed by parameter name;
each fused weight and its Adam moments cut into two halves with the
parameter's ``megatron_fsdp_slice`` and ``make_fsdp_dtensor`` (its SwiGLU
``linear_fc1`` split, here the blocks' ``fc1``); ``preprocess_state_dict_for_
uneven_dtensor``; torch's DCP. Loading builds the same dict on a fresh model
and reads into it in place.

Saved at 2 ranks (ZeRO-3, and ZeRO-1), loaded at 4 (FSDP, HSDP 2 x 2, HFSDP
2 x 2); saved at 4 (HFSDP, and FSDP where one rank's optimizer keeps no state
for a parameter whose part is empty there, as stock's does), loaded at 2:
every weight and optimizer state must come back exactly. A checkpoint of
another model, or one missing an entry, is refused with nothing loaded.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from harness import run_ranks

pytest.importorskip("megatron_fsdp", reason="pip install --no-deps megatron-fsdp==0.6.1 (the test extra's note)")

from test_megatron_fsdp_checkpoints import Block, Net, build_mesh, train_step  # noqa: E402

LAYOUTS = {  # mesh (dp_outer, dp_shard, cp, tp), zero, outer
    "zero3_2": ((1, 2, 1, 1), "optim_grads_params", "no_shard"),
    "zero1_2": ((1, 2, 1, 1), "optim", "no_shard"),
    "zero3_4": ((1, 4, 1, 1), "optim_grads_params", "no_shard"),
    "hsdp_4": ((2, 2, 1, 1), "optim_grads_params", "no_shard"),
    "hfsdp_4": ((2, 2, 1, 1), "optim_grads_params", "optim"),
}
FUSED = ".fc1.weight"


def shard(layout: str, seed: int, net_cls=Net):
    import flatfsdp.megatron_fsdp as mfsdp

    shape, zero, outer = LAYOUTS[layout]
    mesh = build_mesh(shape)
    net = net_cls(seed)
    return mfsdp.fully_shard(
        module=net, optimizer=torch.optim.Adam(net.parameters(), lr=0.01), device_mesh=mesh, dp_shard_dim="dp_shard",
        dp_outer_dim="dp_outer", tp_dim="tp", hybrid_fsdp_group=mesh["hsdp"].get_group(), fsdp_unit_modules=[Block],
        zero_dp_strategy=zero, outer_dp_sharding_strategy=outer, device=torch.device("cpu"),
        mixed_precision_policy=mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                                          main_grads_dtype=torch.float32))


def halves(value: DTensor, param) -> list[DTensor]:
    """The two halves of a fused weight's (or moment's) DTensor, each over its
    run of this rank's part, found with ``megatron_fsdp_slice``."""
    from flatfsdp.megatron_fsdp.param_and_grad_buffer import make_fsdp_dtensor

    run, local = param.megatron_fsdp_slice, value.to_local().reshape(-1)
    half, rows = value.numel() // 2, value.shape[0] // 2
    out = []
    for lo, hi in ((0, half), (half, value.numel())):
        start, stop = max(lo, run.start), min(hi, run.stop)
        piece = local[start - run.start:stop - run.start] if start < stop else local[:0]
        out.append(make_fsdp_dtensor(piece, torch.empty(rows, *value.shape[1:], device="meta"),
                                     param.megatron_fsdp_dist_index, run_check=True,
                                     update_uneven_dtensor_chunk_meta=True))
    return out


def fsdp_dtensor_state(model, optimizer) -> dict:
    """Megatron-LM's fsdp_dtensor state dict (model; optimizer state by parameter name), fused weights split."""
    import flatfsdp.megatron_fsdp.uneven_dtensor as uneven

    params = dict(model.named_parameters())
    model_sd = {}
    for key, value in model.state_dict().items():
        if key.endswith(FUSED):
            model_sd[key + "_w"], model_sd[key + "_v"] = halves(value, params[key])
        else:
            model_sd[key] = value
    optim_sd = {}
    for name, param in params.items():
        if param not in optimizer.state:
            continue  # a rank whose optimizer keeps no state for it (its part is empty there)
        state = dict(optimizer.state[param])
        if name.endswith(FUSED):
            for moment in ("exp_avg", "exp_avg_sq"):
                state[moment + "_w"], state[moment + "_v"] = halves(state.pop(moment), param)
        optim_sd[name] = state
    sd = {"model": model_sd, "optimizer": {"state": optim_sd}}
    uneven.preprocess_state_dict_for_uneven_dtensor(sd)
    return sd


def snapshot(model, optimizer) -> dict:
    """Every weight and Adam moment as a whole tensor, by name (every rank alike)."""
    out = {}
    for name, param in model.named_parameters():
        out[name] = param.full_tensor()
        state = optimizer.state.get(param, {})
        held = [None] * dist.get_world_size()
        dist.all_gather_object(held, sorted(state))
        if any(held):
            for moment in ("exp_avg", "exp_avg_sq"):
                value = state.get(moment, torch.zeros_like(param))
                out[f"{name}:{moment}"] = value.full_tensor()
    return out


def save(layout: str, path: str, rank: int, drop_empty: bool = False) -> dict:
    model, optimizer = shard(layout, seed=0)
    train_step(model, optimizer, rank)
    if drop_empty:  # stock's optimizer keeps no state where a rank's part is empty
        for param in model.parameters():
            if param.to_local().numel() == 0:
                optimizer.state.pop(param, None)
    saved = snapshot(model, optimizer)
    dcp.save(fsdp_dtensor_state(model, optimizer), checkpoint_id=path)
    return saved


def load(layout: str, path: str, net_cls=Net) -> tuple[dict, dict, str | None]:
    model, optimizer = shard(layout, seed=1, net_cls=net_cls)
    optimizer.state_dict()  # flatfsdp makes the optimizer's state here, ready to be read into
    before = snapshot(model, optimizer)
    raw = model.state_dict()
    try:
        dcp.load(fsdp_dtensor_state(model, optimizer), checkpoint_id=path)
    except CheckpointException as error:  # DCP's refusal (a BaseException), raised before it reads anything
        return before, snapshot(model, optimizer), str(error)
    model.load_state_dict(raw)  # as Megatron-LM does next: the engine hears that its weights changed
    return before, snapshot(model, optimizer), None


def members_worker(rank, world, tmp):
    model, optimizer = shard("zero3_2", seed=0)
    fused = dict(model.named_parameters())["module.blocks.0" + FUSED]
    rows = fused.to_local().shape[0]
    copies = [copy.deepcopy(fused), pickle.loads(pickle.dumps(fused))]
    return {"slice": fused.megatron_fsdp_slice, "expected": slice(rank * rows * 16, (rank + 1) * rows * 16),
            "index_mesh": fused.megatron_fsdp_dist_index.get_submesh(["tp"]).size(),
            "copies": [(type(c) is DTensor, torch.equal(c.to_local(), fused.to_local()), c.__fsdp_param__ is True)
                       for c in copies],
            "saved": {"A": save("zero3_2", f"{tmp}/A", rank), "B": save("zero1_2", f"{tmp}/B", rank)}}


def four_worker(rank, world, tmp):
    loads = {layout: load(layout, f"{tmp}/A") for layout in ("zero3_4", "hsdp_4", "hfsdp_4")}
    loads["zero1_2->zero3_4"] = load("zero3_4", f"{tmp}/B")
    return {"loads": loads, "saved": {"C": save("hfsdp_4", f"{tmp}/C", rank),
                                      "D": save("zero3_4", f"{tmp}/D", rank, drop_empty=True)}}


class WiderNet(Net):
    def __init__(self, seed: int):
        super().__init__(seed)
        self.head = torch.nn.Linear(16, 5)


class LongerNet(Net):
    def __init__(self, seed: int):
        super().__init__(seed)
        self.extra = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.extra(super().forward(x))


def back_to_two_worker(rank, world, tmp):
    return {"C": load("zero3_2", f"{tmp}/C"), "D": load("zero3_2", f"{tmp}/D"),
            "another_model": load("zero3_2", f"{tmp}/A", net_cls=WiderNet),
            "missing_key": load("zero3_2", f"{tmp}/A", net_cls=LongerNet)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("fsdp_dtensor"))
    two = run_ranks(members_worker, 2, tmp)
    four = run_ranks(four_worker, 4, tmp)
    back = run_ranks(back_to_two_worker, 2, tmp)
    return two, four, back


def assert_same(saved: dict, loaded: dict) -> None:
    assert saved.keys() == loaded.keys()
    for key, value in saved.items():
        assert torch.equal(value, loaded[key]), key


def test_the_parameters_answer_megatron_fsdps_members(runs):
    for result in runs[0]:
        assert result["slice"] == result["expected"] and result["index_mesh"] == 1
        assert result["copies"] == [(True, True, True)] * 2  # a copy or pickle: a plain DTensor, marker True


@pytest.mark.parametrize("layout", ["zero3_4", "hsdp_4", "hfsdp_4"])
def test_two_ranks_resume_at_four_in_every_layout(runs, layout):
    saved = runs[0][0]["saved"]["A"]
    for before, loaded, error in (r["loads"][layout] for r in runs[1]):
        assert error is None
        assert any(not torch.equal(before[k], saved[k]) for k in saved)  # a fresh model differs until it loads
        assert_same(saved, loaded)


def test_another_strategy_reshards_too(runs):
    saved = runs[0][0]["saved"]["B"]
    for _, loaded, error in (r["loads"]["zero1_2->zero3_4"] for r in runs[1]):
        assert error is None
        assert_same(saved, loaded)


@pytest.mark.parametrize("name", ["C", "D"])
def test_four_ranks_resume_at_two(runs, name):
    saved = runs[1][0]["saved"][name]
    for _, loaded, error in (r[name] for r in runs[2]):
        assert error is None
        assert_same(saved, loaded)


def test_a_rank_without_optimizer_state_for_an_empty_part_still_saves(runs):
    """zero3_4: the head's 3 rows lie on ranks 0-2; rank 3 kept no state for them."""
    saved = runs[1][0]["saved"]["D"]
    assert saved["module.head.weight:exp_avg"].abs().sum() > 0


@pytest.mark.parametrize("case, names", [("another_model", "module.head.weight"),
                                         ("missing_key", "module.extra.weight")])
def test_a_checkpoint_that_does_not_fit_is_refused_with_nothing_loaded(runs, case, names):
    for before, after, error in (r[case] for r in runs[2]):
        assert error is not None and names in error
        assert_same(before, after)
