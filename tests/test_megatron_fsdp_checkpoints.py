"""Checkpoints move between stock megatron-fsdp 0.6.1 and flatfsdp.megatron_fsdp
with the same user code, both ways, at ZeRO-1/2/3, HSDP and HFSDP.

The user code is Megatron-FSDP's own (its test_dcp_checkpoint_save_and_load):
``fully_shard(model, optimizer, ...)``, one training step,
``dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()})``;
then a differently initialised model, ``fully_shard`` again, ``dcp.load`` into
its state dicts, ``model.load_state_dict`` and ``optimizer.load_state_dict``.
The only difference between the libraries is the import. What is compared is
each value as a whole (assembled from every rank's chunk as the DTensor's
chunk list places it, the way DCP reads it): every weight and every optimizer
state, exactly, under each optimizer index -- which must name the same
parameter on both sides (stock numbers parameters in the model's order).

Two ranks; the meshes are the suite's (dp_outer, dp_shard, cp, tp): (1, 2, 1, 1)
for ZeRO-1/2/3 and (2, 1, 1, 1) for HSDP and HFSDP -- two replicas, each one
rank, so HFSDP's optimizer-state split runs across the outer dimension.
Stock runs on CPU with test_megatron_loop's stand-ins (in the worker only).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from harness import run_ranks

pytest.importorskip("megatron_fsdp", reason="pip install --no-deps megatron-fsdp==0.6.1 (the test extra's note)")

from test_megatron_loop import _stock_megatron_fsdp_on_cpu  # noqa: E402  (the CPU stand-ins, worker-only)

D = 16
LAYOUTS = {
    "zero1": ((1, 2, 1, 1), "optim", "no_shard"),
    "zero2": ((1, 2, 1, 1), "optim_grads", "no_shard"),
    "zero3": ((1, 2, 1, 1), "optim_grads_params", "no_shard"),
    "hsdp": ((2, 1, 1, 1), "optim_grads_params", "no_shard"),
    "hfsdp": ((2, 1, 1, 1), "optim_grads_params", "optim"),
}
DIRECTIONS = (("stock", "flatfsdp"), ("flatfsdp", "stock"), ("flatfsdp", "flatfsdp"))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 3 * D), nn.Linear(3 * D, D)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(5, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def library(name: str):
    if name == "stock":
        return _stock_megatron_fsdp_on_cpu()
    import flatfsdp.megatron_fsdp
    return flatfsdp.megatron_fsdp


def build_mesh(shape):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_outer", "dp_shard", "cp", "tp"))
    mesh[("dp_outer", "dp_shard", "cp")]._flatten("hsdp")
    return mesh


def shard(lib, mesh, layout: str, seed: int, two_groups: bool = False):
    """Megatron-FSDP's user code, the same for both libraries."""
    _, zero, outer = LAYOUTS[layout]
    net = Net(seed)
    if two_groups:  # the blocks first, then the rest: not the model's order
        rest = [p for n, p in net.named_parameters() if not n.startswith("blocks.")]
        optimizer = torch.optim.Adam([{"params": net.blocks.parameters(), "lr": 0.02}, {"params": rest}], lr=0.01)
    else:
        optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    return lib.fully_shard(
        module=net, optimizer=optimizer, device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
        tp_dim="tp", hybrid_fsdp_group=mesh["hsdp"].get_group(), fsdp_unit_modules=[Block], zero_dp_strategy=zero,
        outer_dp_sharding_strategy=outer, device=torch.device("cpu"),
        mixed_precision_policy=lib.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                                        main_grads_dtype=torch.float32),
        sync_model_each_microbatch=True)


def train_step(model, optimizer, rank: int) -> None:
    gen = torch.Generator().manual_seed(7 + rank)
    loss = model(torch.randn(4, 5, generator=gen)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def whole(value):
    """A state-dict value as a whole tensor: a DTensor from every rank's chunk,
    placed by its chunk list (what DCP writes and reads). ``value`` may be
    None on a rank that holds no entry (stock keeps no optimizer state where
    a rank's chunk is empty); every rank calls this for the same entry."""
    mine = None
    if isinstance(value, DTensor):
        local = value.to_local().detach()
        chunks = [(tuple(c.offsets), tuple(c.sizes), local.reshape(tuple(c.sizes)).clone())
                  for c in value.__create_chunk_list__() if local.numel() > 0]
        mine = (tuple(value.shape), value.dtype, chunks)
    elif isinstance(value, torch.Tensor):
        mine = (tuple(value.shape), value.dtype, [((0,) * value.dim(), tuple(value.shape), value.detach().clone())])
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine if mine is not None else value)
    known = [e for e in every if isinstance(e, tuple)]
    if not known:
        return value
    full = torch.zeros(known[0][0], dtype=known[0][1])
    for offsets, sizes, data in (chunk for e in known for chunk in e[2]):
        full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = data
    return full


def snapshot(model, optimizer) -> dict:
    """Every weight and optimizer state as a whole tensor, keyed alike on every rank."""
    model_sd, optim_sd = model.state_dict(), optimizer.state_dict()
    entries = {(i, k) for i, s in optim_sd["state"].items() for k in s}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, entries)
    state: dict = {}
    for i, k in sorted(set().union(*every)):
        state.setdefault(i, {})[k] = whole(optim_sd["state"].get(i, {}).get(k))
    return {"model": {k: whole(v) for k, v in model_sd.items()}, "state": state,
            "lr": [g["lr"] for g in optim_sd["param_groups"]]}


def save(lib_name: str, layout: str, path: str, rank: int, two_groups: bool = False) -> dict:
    lib = library(lib_name)
    mesh = build_mesh(LAYOUTS[layout][0])
    model, optimizer = shard(lib, mesh, layout, seed=0, two_groups=two_groups)
    train_step(model, optimizer, rank)
    saved = snapshot(model, optimizer)
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path)
    return saved


def load(lib_name: str, layout: str, path: str, two_groups: bool = False):
    lib = library(lib_name)
    mesh = build_mesh(LAYOUTS[layout][0])
    model, optimizer = shard(lib, mesh, layout, seed=1, two_groups=two_groups)
    before = snapshot(model, optimizer)
    try:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (Exception, CheckpointException) as error:  # the refusal is the result (DCP's is a BaseException)
        return before, snapshot(model, optimizer), f"{type(error).__name__}: {error}"
    return before, snapshot(model, optimizer), None


def exchange_worker(rank, world, tmp):
    out = {}
    for layout in LAYOUTS:
        for writer, reader in DIRECTIONS:
            path = f"{tmp}/{layout}-{writer}-{reader}"
            saved = save(writer, layout, path, rank)
            _, loaded, error = load(reader, layout, path)
            out[(layout, writer, reader)] = (saved, loaded, error)
    return out


@pytest.fixture(scope="module")
def exchanges(tmp_path_factory):
    return run_ranks(exchange_worker, 2, str(tmp_path_factory.mktemp("mfsdp_ckpt")))[0]


def assert_same(saved: dict, loaded: dict) -> None:
    assert saved["model"].keys() == loaded["model"].keys()
    for key, value in saved["model"].items():
        assert torch.equal(value, loaded["model"][key]), key
    assert saved["state"].keys() == loaded["state"].keys() and saved["state"]
    for index, entries in saved["state"].items():
        assert entries.keys() == loaded["state"][index].keys(), index
        for name, value in entries.items():
            assert torch.equal(value, loaded["state"][index][name]), (index, name)
    assert saved["lr"] == loaded["lr"]


@pytest.mark.parametrize("writer, reader", DIRECTIONS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_checkpoint_moves_with_weights_and_optimizer_state_exactly(exchanges, layout, writer, reader):
    saved, loaded, error = exchanges[(layout, writer, reader)]
    assert error is None, error
    assert all(k.startswith("module.") for k in saved["model"])  # both wrap the model: stock's spelling
    assert_same(saved, loaded)


def test_each_optimizer_index_names_the_model_parameter_of_that_place(exchanges):
    """The state of index i has the shape of the model's i-th parameter, on
    both sides (the exchange above would fail on a shape clash; this pins the
    meaning itself)."""
    for side in ("stock", "flatfsdp"):
        saved, _, _ = exchanges[("zero3", side, "flatfsdp" if side == "stock" else "stock")]
        shapes = [v.shape for v in saved["model"].values()]
        for index, entries in saved["state"].items():
            assert entries["exp_avg"].shape == shapes[index], (side, index)


# --- two param groups: round-trip within flatfsdp, refused across (stock collapses groups) ----

def two_groups_worker(rank, world, tmp):
    out = {}
    saved = save("flatfsdp", "zero3", f"{tmp}/ff2", rank, two_groups=True)
    out["own"] = (saved,) + load("flatfsdp", "zero3", f"{tmp}/ff2", two_groups=True)
    out["into_stock"] = (saved,) + load("stock", "zero3", f"{tmp}/ff2")
    stock_saved = save("stock", "zero3", f"{tmp}/st", rank)
    out["from_stock"] = (stock_saved,) + load("flatfsdp", "zero3", f"{tmp}/st", two_groups=True)
    return out


@pytest.fixture(scope="module")
def two_groups(tmp_path_factory):
    return run_ranks(two_groups_worker, 2, str(tmp_path_factory.mktemp("mfsdp_groups")))[0]


def test_two_param_groups_out_of_model_order_round_trip_with_their_own_hyperparameters(two_groups):
    saved, _, loaded, error = two_groups["own"]
    assert error is None, error
    assert saved["lr"] == [0.02, 0.01]
    assert_same(saved, loaded)
    in_groups = [k for k in saved["model"] if ".blocks." in k] + [k for k in saved["model"] if ".blocks." not in k]
    shapes = [saved["model"][k].shape for k in in_groups]
    # torch's numbering, the optimizer's own order (what get_optimizer_state_dict names entries by)
    assert all(e["exp_avg"].shape == shapes[i] for i, e in saved["state"].items())


def test_stock_one_group_into_two_groups_is_refused_with_nothing_loaded(two_groups):
    """Stock's collapsed group is another optimizer: DCP's plan refuses it
    (a key or a shape that differs) before any value is read."""
    _, before, after, error = two_groups["from_stock"]
    assert error is not None and ("param_groups" in error or "Size mismatch" in error), error
    assert_same(before, after)


def test_two_groups_into_stock_are_refused_with_nothing_loaded(two_groups):
    """Both number state as torch does, each in its own optimizer's order: the
    two groups' first entry is a block's LayerNorm weight, stock's the input
    layer's weight, and DCP's plan refuses the shapes before reading."""
    _, before, after, error = two_groups["into_stock"]
    assert error is not None and "Size mismatch" in error, error
    assert_same(before, after)


# --- name-keyed: NeMo AutoModel's way (fully_shard_model, then fully_shard_optimizer on two groups) ---

def named_shard(lib, mesh, seed: int):
    """NeMo AutoModel's order: the model first, then an optimizer of two groups
    (not in the model's order) on its distributed parameters, then binding.
    Stock keeps those groups here (only its combined fully_shard collapses them)."""
    model = lib.fully_shard_model(Net(seed), device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                                  tp_dim="tp", hybrid_fsdp_group=mesh["hsdp"].get_group(), fsdp_unit_modules=[Block],
                                  zero_dp_strategy=3, device=torch.device("cpu"),
                                  mixed_precision_policy=lib.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                                                                  main_grads_dtype=torch.float32))
    model._replace_param_with_distributed_if_needed()
    named = dict(model.named_parameters())
    blocks = [p for n, p in named.items() if ".blocks." in n]
    rest = [p for n, p in named.items() if ".blocks." not in n]
    optimizer = torch.optim.Adam([{"params": blocks, "lr": 0.02}, {"params": rest}], lr=0.01)
    return model, lib.fully_shard_optimizer(optimizer)


def named_moments(model, optimizer) -> dict:
    """Every moment as a whole tensor, by parameter name (the name-keyed state dict's own keys)."""
    state = get_optimizer_state_dict(model, optimizer)["state"]
    names = sorted(state)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, names)
    return {(n, k): whole(state.get(n, {}).get(k)) for n in sorted(set().union(*every))
            for k in ("exp_avg", "exp_avg_sq", "step")}


def named_worker(rank, world, tmp):
    """Save after a step; the writer takes a second step, the reader loads and
    takes the same step: the weights must agree (a moment filed under another
    parameter moves it elsewhere). Where flatfsdp reads, every moment is also
    compared by name (stock's own state_dict cannot be read back after such a
    load on CPU: its uneven-DTensor hook fails on the state it just loaded)."""
    flatten = StateDictOptions(flatten_optimizer_state_dict=True)
    out = {}
    for writer, reader in NAMED_DIRECTIONS:
        mesh = build_mesh(LAYOUTS["zero3"][0])
        model, optimizer = named_shard(library(writer), mesh, seed=0)
        train_step(model, optimizer, rank)
        saved = named_moments(model, optimizer)
        path = f"{tmp}/named-{writer}-{reader}"
        dcp.save({"model": get_model_state_dict(model),
                  "optim": get_optimizer_state_dict(model, optimizer, options=flatten)}, checkpoint_id=path)
        train_step(model, optimizer, rank)
        continued = {k: whole(v) for k, v in model.state_dict().items()}
        model, optimizer = named_shard(library(reader), mesh, seed=1)
        state = {"model": get_model_state_dict(model),
                 "optim": get_optimizer_state_dict(model, optimizer, options=flatten)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"], options=flatten)
        loaded = named_moments(model, optimizer) if reader == "flatfsdp" else None
        train_step(model, optimizer, rank)
        out[(writer, reader)] = (saved, loaded, continued, {k: whole(v) for k, v in model.state_dict().items()})
    return out


NAMED_DIRECTIONS = (("stock", "flatfsdp"), ("flatfsdp", "stock"), ("flatfsdp", "flatfsdp"))


@pytest.fixture(scope="module")
def named_exchanges(tmp_path_factory):
    return run_ranks(named_worker, 2, str(tmp_path_factory.mktemp("mfsdp_named")))[0]


@pytest.mark.parametrize("writer, reader", NAMED_DIRECTIONS)
def test_name_keyed_state_of_two_groups_moves_with_every_moment_under_its_name(named_exchanges, writer, reader):
    saved, loaded, continued, resumed = named_exchanges[(writer, reader)]
    moments = {key: value for key, value in saved.items() if key[1] != "step"}
    assert len(moments) == 2 * 16  # every parameter of Net (16) has both Adam moments, on some rank
    if loaded is not None:
        for key, value in moments.items():
            assert torch.equal(value, loaded[key]), key
    assert continued.keys() == resumed.keys()
    for key, value in continued.items():
        assert torch.allclose(value, resumed[key], rtol=1e-6, atol=1e-7), key
