"""Optimizer state is never filed under another parameter.

Every way a user saves and loads optimizer state -- ``optimizer.state_dict()``,
``get/set_optimizer_state_dict`` (name-keyed, flattened or not), DCP -- through
each door (FSDP2's per-module ``fully_shard``, the one-call ``fully_shard``,
and the megatron_fsdp package's ``fully_shard_model`` +
``fully_shard_optimizer``, NeMo AutoModel's order), with two param groups in
another order than the model's, a frozen parameter inside a group, and a
parameter whose shard is empty on rank 1 (``head``, one output row).

What is compared is each optimizer moment as a whole tensor, under the name
the state dict files it under, against an unsharded AdamW trained on the same
global batches: a moment of ``blocks.0`` filed under ``blocks.1`` (the same
shapes) fails the comparison, not only a shape check. After a round trip
through DCP into a differently initialised model, the next step's loss and
every moment equal the uninterrupted reference's. A bound optimizer refuses,
naming the parameter and the rank, state of another model, of another group
structure, with a parameter left out, or named for another place -- on every
rank, with nothing loaded.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from harness import run_ranks

D = 8
LR = (0.02, 0.01)
DOORS = ("fsdp2", "one_call", "megatron")
MOMENTS = ("exp_avg", "exp_avg_sq")
ROUND_TRIPS = {"fsdp2": ("named",), "one_call": ("raw", "named"), "megatron": ("raw", "named")}
"""A raw ``optimizer.state_dict()`` loads in place only into an optimizer that
has state: a bound optimizer makes it on ``state_dict()``; FSDP2's door, like
FSDP2, leaves a fresh plain optimizer empty (DCP then has nothing to fill) --
its users load through ``set_optimizer_state_dict``."""


class Block(nn.Module):
    def __init__(self, width: int = D):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.ln(x)))


class Net(nn.Module):
    def __init__(self, seed: int, width: int = D):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(4, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(width, 1)  # one row: rank 1's shard of it is empty

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.frozen(x))


def group_names(names: list[str]) -> list[list[str]]:
    """Two groups, neither in the model's order: head and the second block
    first, then the rest (the frozen weight inside it)."""
    first = [n for n in names if n.startswith(("head.", "blocks.1."))]
    return [first, [n for n in names if n not in first]]


def make_optimizer(named: dict[str, nn.Parameter]) -> torch.optim.Optimizer:
    groups = group_names(list(named))
    return torch.optim.AdamW([{"params": [named[n] for n in g], "lr": lr} for g, lr in zip(groups, LR)],
                             weight_decay=0.1)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)


def plain_name(name: str) -> str:
    return name.removeprefix("module.")


def reference(steps: int) -> tuple[list[float], dict[str, dict[str, torch.Tensor]]]:
    """The unsharded run: losses, and each parameter's moments by name."""
    net = Net(seed=0)
    opt = make_optimizer(dict(net.named_parameters()))
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    moments = {n: {k: opt.state[p][k].clone() for k in MOMENTS} for n, p in net.named_parameters() if p in opt.state}
    return losses, moments


def shard(door: str, seed: int, mesh):
    net = Net(seed)
    if door == "fsdp2":
        import flatfsdp
        for block in net.blocks:
            flatfsdp.fully_shard(block, mesh=mesh)
        model = flatfsdp.fully_shard(net, mesh=mesh)
        return model, make_optimizer(dict(model.named_parameters()))
    if door == "one_call":
        import flatfsdp
        optimizer = make_optimizer(dict(net.named_parameters()))
        return flatfsdp.fully_shard(net, optimizer, device_mesh=mesh, dp_shard_dim="dp", fsdp_unit_modules=[Block],
                                    zero_dp_strategy=3, device=torch.device("cpu"))
    import flatfsdp.megatron_fsdp as megatron_fsdp
    model = megatron_fsdp.fully_shard_model(net, device_mesh=mesh, dp_shard_dim="dp", fsdp_unit_modules=[Block],
                                            zero_dp_strategy=3, device=torch.device("cpu"))
    model._replace_param_with_distributed_if_needed()
    optimizer = make_optimizer({plain_name(n): p for n, p in model.named_parameters()})
    return model, megatron_fsdp.fully_shard_optimizer(optimizer)


def step(model, optimizer, index: int, rank: int) -> float:
    x, y = batch(index)
    rows = slice(4 * rank, 4 * rank + 4)
    loss = nn.functional.mse_loss(model(x[rows]), y[rows])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def whole(value) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def by_position(optimizer) -> list:
    """torch's numbering: each parameter at its first place in the groups."""
    seen: list = []
    for group in optimizer.param_groups:
        seen += [p for p in group["params"] if all(p is not q for q in seen)]
    return seen


def filed_moments(model, optimizer) -> dict[str, dict]:
    """What each way of saving files under each parameter name, as whole tensors."""
    names = {id(p): plain_name(n) for n, p in model.named_parameters()}
    raw = optimizer.state_dict()
    params = by_position(optimizer)
    out = {"state_dict": {names[id(params[i])]: {k: whole(s[k]) for k in MOMENTS} for i, s in sorted(raw["state"].items())}}
    named = get_optimizer_state_dict(model, optimizer)
    out["named"] = {plain_name(n): {k: whole(s[k]) for k in MOMENTS} for n, s in sorted(named["state"].items())}
    flat = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    out["flattened"] = {}
    for key, value in sorted(flat.items()):
        if key.startswith("state.") and key.rsplit(".", 1)[1] in MOMENTS:
            name, moment = key[len("state."):].rsplit(".", 1)
            out["flattened"].setdefault(plain_name(name), {})[moment] = whole(value)
    return out


def moments_of(model, optimizer) -> dict[str, dict]:
    names = {id(p): plain_name(n) for n, p in model.named_parameters()}
    return {names[id(p)]: {k: whole(optimizer.state[p][k]) for k in MOMENTS}
            for p in by_position(optimizer) if p in optimizer.state and "exp_avg" in optimizer.state[p]}


def round_trip(door, mesh, rank, path, how):
    """Save after 2 steps, load into a fresh model (another seed), step once."""
    model, optimizer = shard(door, 0, mesh)
    for i in range(2):
        step(model, optimizer, i, rank)
    flatten = StateDictOptions(flatten_optimizer_state_dict=True)
    if how == "raw":
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=path)
    else:
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer, options=flatten)},
                 checkpoint_id=path)
    model, optimizer = shard(door, 1, mesh)
    if how == "raw":
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
    else:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer, options=flatten)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"], options=flatten)
    loss = step(model, optimizer, 2, rank)
    return loss, moments_of(model, optimizer)


def refusals(mesh, rank):
    """Bad input into a bound optimizer (the megatron door): the error, and whether anything changed."""
    out = {}
    model, optimizer = shard("megatron", 0, mesh)
    step(model, optimizer, 0, rank)
    before = moments_of(model, optimizer)
    good = optimizer.state_dict()

    other_net = Net(0, width=D + 2)
    other = make_optimizer(dict(other_net.named_parameters()))
    nn.functional.mse_loss(other_net(batch(0)[0]), batch(0)[1]).backward()
    other.step()
    one_group = torch.optim.AdamW(by_position(optimizer))
    missing = {**good, "state": {k: v for k, v in good["state"].items() if k != 0}}
    named = get_optimizer_state_dict(model, optimizer)
    misnamed = {**named, "param_groups": [{**g, "params": list(g["params"])} for g in named["param_groups"]]}
    misnamed["param_groups"][0]["params"][:2] = misnamed["param_groups"][0]["params"][1::-1]
    trained, trained_optimizer = shard("megatron", 0, mesh)
    for i in range(2):
        step(trained, trained_optimizer, i, rank)
    one_rank = missing if rank == 0 else trained_optimizer.state_dict()  # rank 1's would load and change values
    cases = {"other_model": other.state_dict(), "group_structure": one_group.state_dict(), "missing": missing,
             "misnamed": misnamed, "one_rank_only": one_rank}
    for case, state in cases.items():
        try:
            optimizer.load_state_dict(state)
            out[case] = None
        except ValueError as error:
            out[case] = str(error)
        out[case + "_unchanged"] = all(torch.equal(before[n][k], v) for n, m in moments_of(model, optimizer).items()
                                       for k, v in m.items())
    return out


def worker(rank, world, tmp):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    out = {"doors": {}, "round_trips": {}}
    for door in DOORS:
        model, optimizer = shard(door, 0, mesh)
        for i in range(2):
            step(model, optimizer, i, rank)
        head_bias = dict(model.named_parameters())[("module." if door == "megatron" else "") + "head.bias"]
        out["doors"][door] = {"filed": filed_moments(model, optimizer),
                              "head_bias_local": head_bias.to_local().numel(),
                              "head_bias_has_state": head_bias in optimizer.state,
                              "frozen_has_state": any("frozen" in n for n in moments_of(model, optimizer))}
        for how in ROUND_TRIPS[door]:
            out["round_trips"][(door, how)] = round_trip(door, mesh, rank, f"{tmp}/{door}-{how}", how)
    out["refusals"] = refusals(mesh, rank)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(worker, 2, str(tmp_path_factory.mktemp("optim_names")))


@pytest.fixture(scope="module")
def ref():
    return reference(3)


@pytest.fixture(scope="module")
def ref_moments_after_two():
    return reference(2)[1]


def assert_moments_equal(got: dict, want: dict, label: str) -> None:
    assert set(got) == set(want), (label, sorted(set(got) ^ set(want)))
    for name, moments in want.items():
        for key, value in moments.items():
            assert torch.allclose(got[name][key], value, rtol=1e-4, atol=1e-7), (label, name, key)


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("way", ["state_dict", "named", "flattened"])
def test_every_way_of_saving_files_each_moment_under_its_own_parameter(runs, ref_moments_after_two, door, way):
    assert_moments_equal(runs[0]["doors"][door]["filed"][way], ref_moments_after_two, f"{door}/{way}")


@pytest.mark.parametrize("door", DOORS)
def test_an_empty_shard_keeps_state_on_its_rank_and_a_frozen_parameter_none(runs, door):
    ranks = [r["doors"][door] for r in runs]
    assert [r["head_bias_local"] for r in ranks] == [1, 0]  # rank 1's chunk of head.bias is empty
    assert all(r["head_bias_has_state"] for r in ranks)  # so every rank's state dict names the same entries
    assert not any(r["frozen_has_state"] for r in ranks)


@pytest.mark.parametrize("door, how", [(d, h) for d in DOORS for h in ROUND_TRIPS[d]])
def test_a_round_trip_continues_the_uninterrupted_run(runs, ref, door, how):
    losses, moments = ref
    loss, resumed = runs[0]["round_trips"][(door, how)]
    assert abs(loss - losses[2]) < 1e-6, (door, how, loss, losses[2])
    assert_moments_equal(resumed, moments, f"{door}/{how}")


@pytest.mark.parametrize("case, words", [
    ("other_model", ["shape", "blocks.1.ln.weight"]),
    ("group_structure", ["1 param group(s)", "2 of"]),
    ("missing", ["no state for", "blocks.1.ln.weight"]),
    ("misnamed", ["names", "where this optimizer holds"]),
])
def test_a_state_that_does_not_fit_is_refused_by_name_with_nothing_loaded(runs, case, words):
    for rank in runs:
        error = rank["refusals"][case]
        assert error is not None and "nothing was loaded" in error, (case, error)
        assert all(w in error for w in words), (case, error)
        assert rank["refusals"][case + "_unchanged"], case


def test_a_refusal_on_one_rank_is_every_ranks_refusal(runs):
    for rank in runs:
        error = rank["refusals"]["one_rank_only"]
        assert error is not None and "rank 0:" in error and "rank 1:" not in error, error
        assert rank["refusals"]["one_rank_only_unchanged"]
