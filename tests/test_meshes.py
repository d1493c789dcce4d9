"""N-D meshes (issue 11): HSDP, context-, tensor- and expert-parallel
composition, at world 4 (2 x 2) on real gloo processes. Every layout trains
against an unsharded reference on the same global batch (fp32, within 1e-5),
and the bytes each step moves per mesh dimension are asserted against the
formulas in docs/meshes.md. All scenarios run in one set of processes
(spawning is the slow part); each test asserts on its own scenario."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run_ranks

DIM = 16
TOL = 1e-5
WORLD = 4


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, 2 * DIM)
        self.w2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))


class Net(nn.Module):
    def __init__(self, blocks: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(MLP() for _ in range(blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, 5)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _batches(n: int, size: int = 8):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(size, DIM, generator=gen) for _ in range(n)]


def _slice(x: torch.Tensor, index: int, ways: int) -> torch.Tensor:
    per = x.shape[0] // ways
    return x[index * per:(index + 1) * per]


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _max_diff(model: nn.Module, ref: nn.Module) -> float:
    return max((_full(p).detach().double() - q.detach().double()).abs().max().item()
               for (_, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()))


def _train(model, ref, opt, *, dp_index: int, dp_ways: int, steps: int = 3, microbatches: int = 1,
           before=None, forward=None):
    """Adam on both; the sharded model sees its data-parallel slice of each
    global batch. Returns (max parameter difference, per-step comm by dim)."""
    import flatfsdp

    forward = forward or (lambda m, x: m(x))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    per_step = []
    for x in _batches(steps):
        flatfsdp.comm_account().reset()
        for i, mb in enumerate(x.chunk(microbatches)):
            if before:
                before(model, i == microbatches - 1)
            (forward(model, _slice(mb, dp_index, dp_ways)).pow(2).mean() / microbatches).backward()
            (forward(ref, mb).pow(2).mean() / microbatches).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        per_step.append(flatfsdp.comm_account().by_dim())
    return _max_diff(model, ref), per_step


def _group_bytes(model, kind: str) -> list[tuple]:
    """(shard numel, element bytes of the reduce dtype, sharded) of every
    trainable param group: the terms of the byte formulas."""
    from flatfsdp.engine.runtime.unit_state import unit_states

    out = []
    for state in unit_states(model):
        for group in state.groups:
            if group.trainable:
                replicas = group.buffers.replicas
                pieces = replicas.main_numel if replicas.splits_main else None
                out.append((group.layout.shard_numel, group.buffers.grads.data.element_size(), group.placement.sharded,
                            group.layout.unsharded_numel, pieces))
    return out


def _scenarios(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    import flatfsdp

    out = {}

    # ---- HSDP, FSDP2 style: fully_shard(m, mesh=2-D (replicate, shard)) ------------------------
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _net()
    ref = copy.deepcopy(model)
    for block in model.blocks:
        flatfsdp.fully_shard(block, mesh=mesh)
    flatfsdp.fully_shard(model, mesh=mesh)
    out["hsdp_fsdp2_placements"] = {str(p.placements) for p in model.parameters()}
    out["hsdp_fsdp2_mesh"] = {tuple(p.device_mesh.mesh_dim_names) for p in model.parameters()}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out["hsdp_fsdp2"], comm = _train(model, ref, opt, dp_index=rank, dp_ways=world)
    out["hsdp_fsdp2_comm"] = comm[-1]
    out["hsdp_fsdp2_groups"] = _group_bytes(model, "grads")

    # ---- HSDP, Megatron-FSDP style, every inner strategy ----------------------------------------
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    mesh[("dp_outer", "dp_shard")]._flatten("dp")
    for strategy in (0, 1, 2, 3):
        model = _net()
        ref = copy.deepcopy(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        model, opt = flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[MLP], device_mesh=mesh,
                                          dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                                          hybrid_fsdp_group=mesh["dp"].get_group(), zero_dp_strategy=strategy)
        out[f"hsdp_zero{strategy}"], _ = _train(model, ref, opt, dp_index=rank, dp_ways=world)
        out[f"hsdp_zero{strategy}_persistent"] = flatfsdp.persistent_buffer_bytes(model)
        out[f"hsdp_zero{strategy}_groups"] = _group_bytes(model, "grads")

    # ---- HSDP with gradient accumulation: outer traffic once per step ---------------------------
    def make(**kw):
        model = _net()
        ref = copy.deepcopy(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        model, opt = flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[MLP], device_mesh=mesh,
                                          dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", **kw)
        return model, ref, opt

    def no_sync(m, last):
        m.set_requires_gradient_sync(last)

    def no_all_reduce(m, last):
        m.set_requires_all_reduce(last)

    for name, kw, before in (("no_sync", {}, no_sync), ("deferred", dict(sync_model_each_microbatch=False), None),
                             ("requires_all_reduce", {}, no_all_reduce), ("every_microbatch", {}, None)):
        model, ref, opt = make(**kw)
        out[f"accum_{name}"], comm = _train(model, ref, opt, dp_index=rank, dp_ways=world, microbatches=2,
                                            before=before)
        out[f"accum_{name}_comm"] = comm[-1]
        out[f"accum_{name}_groups"] = _group_bytes(model, "grads")

    # ---- HFSDP: optimizer state sharded across the outer dimension too -------------------------
    for name, kw, microbatches in (("hfsdp", {}, 1), ("hfsdp_accum", dict(sync_model_each_microbatch=False), 2)):
        model, ref, opt = make(outer_dp_sharding_strategy="optim", **kw)
        out[f"{name}_placements"] = {n: str(p.placements) for n, p in model.named_parameters()}
        out[f"{name}_meshes"] = {tuple(p.device_mesh.mesh_dim_names) for p in model.parameters()}
        out[name], comm = _train(model, ref, opt, dp_index=rank, dp_ways=world, microbatches=microbatches)
        out[f"{name}_comm"] = comm[-1]
        out[f"{name}_groups"] = _group_bytes(model, "grads")
        out[f"{name}_persistent"] = flatfsdp.persistent_buffer_bytes(model)

    # ---- Context parallel: shard and reduce over the flattened (dp_shard, cp) -------------------
    cp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    cp_mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    model = _net()
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[MLP], device_mesh=cp_mesh,
                                      dp_shard_dim="dp_shard_cp")
    # Each (dp_shard, cp) rank holds a different part of the tokens; the
    # model is token-wise, so the global mean is the mean over the four parts.
    index = cp_mesh["dp_shard_cp"].get_local_rank()
    out["cp"], comm = _train(model, ref, opt, dp_index=index, dp_ways=world)
    out["cp_comm"] = comm[-1]
    out["cp_shard_size"] = {p.device_mesh.size() for p in model.parameters()}
    out["cp_memory"] = (flatfsdp.persistent_buffer_bytes(model), _group_bytes(model, "grads"))

    # ---- Tensor parallel: DTensor parameters, sharded over DP only ------------------------------
    for style in ("fsdp2", "megatron"):
        tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = _tp_net(tp_mesh["tp"])
        ref = _net()
        dp_index = tp_mesh["dp"].get_local_rank()
        if style == "fsdp2":
            for block in model.blocks:
                flatfsdp.fully_shard(block, mesh=tp_mesh["dp"])
            flatfsdp.fully_shard(model, mesh=tp_mesh["dp"])
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        else:
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            model, opt = flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[MLP], device_mesh=tp_mesh,
                                              dp_shard_dim="dp", tp_dim="tp")
        out[f"tp_{style}_placements"] = {n: str(p.placements) for n, p in model.named_parameters()}
        out[f"tp_{style}"], comm = _train(model, ref, opt, dp_index=dp_index, dp_ways=2)
        out[f"tp_{style}_comm"] = comm[-1]
        out[f"tp_{style}_groups"] = _group_bytes(model, "grads")
        out[f"tp_{style}_memory"] = (flatfsdp.persistent_buffer_bytes(model), out[f"tp_{style}_groups"])

    # ---- Expert parallel: a small mixture-of-experts block --------------------------------------
    out.update(_expert_scenario(rank, world))
    return out


def _tp_net(tp_mesh) -> Net:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _net()
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    return model


class MoE(nn.Module):
    """Dense mixture of experts: every token goes through every expert,
    weighted by a softmax router. With expert parallelism each rank of an EP
    group holds one expert: tokens of the group are summed in (all-reduce
    with autograd), each rank applies its expert, and the weighted outputs are
    summed back. Without a group it holds all experts (the reference)."""

    def __init__(self, experts: int = 2, ep_group=None):
        super().__init__()
        self.router = nn.Linear(DIM, experts)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(experts))
        self.head = nn.Linear(DIM, 5)
        self.ep_group = ep_group

    def forward(self, x):
        if self.ep_group is None:
            gate = torch.softmax(self.router(x), dim=-1)
            y = sum(gate[:, e:e + 1] * torch.tanh(expert(x)) for e, expert in enumerate(self.experts))
            return self.head(x + y)
        from torch.distributed.nn.functional import all_reduce

        size, me, n = self.ep_group.size(), self.ep_group.rank(), x.shape[0]
        spread = x.new_zeros(size * n, x.shape[1])
        spread[me * n:(me + 1) * n] = x
        tokens = all_reduce(spread, group=self.ep_group)
        gate = torch.softmax(self.router(tokens), dim=-1)
        mine = gate[:, me:me + 1] * torch.tanh(self.experts[0](tokens))  # its one expert: number ``me``
        y = all_reduce(mine, group=self.ep_group)[me * n:(me + 1) * n]
        return self.head(x + y)


def _expert_scenario(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import flatfsdp

    # rank = edp * 2 + ep: EP groups {0,1} {2,3}; expert data-parallel groups {0,2} {1,3}.
    expert_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
    ep = expert_mesh["ep"].get_local_rank()
    torch.manual_seed(0)
    ref = MoE()
    model = copy.deepcopy(ref)
    model.ep_group = expert_mesh["ep"].get_group()
    # This rank holds one expert (the reference's expert ``ep``), marked the
    # Megatron-Core way.
    model.experts = nn.ModuleList([model.experts[ep]])
    for p in model.experts.parameters():
        p.allreduce = False
    world_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[], device_mesh=world_mesh,
                                      expt_device_mesh=expert_mesh, dp_shard_dim="dp_shard")
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for x in _batches(3):
        model(_slice(x, rank, world)).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    # Compare: shared parameters whole; this rank's expert against the reference's expert ``ep``.
    reference = dict(ref.named_parameters())
    diffs = [(_full(p) - reference[n]).abs().max().item() for n, p in model.named_parameters()
             if not n.startswith("experts")]
    for p, q in zip(model.experts[0].parameters(), ref.experts[ep].parameters()):
        diffs.append((_full(p) - q).abs().max().item())
    expert_meshes = {p.device_mesh.size() for p in model.experts.parameters()}
    return {"ep": max(diffs), "ep_expert_mesh_sizes": expert_meshes,
            "ep_memory": (flatfsdp.persistent_buffer_bytes(model), _group_bytes(model, "grads"))}


@functools.lru_cache(maxsize=1)
def _results():
    return run_ranks(_scenarios, WORLD, timeout=900)


def _all(key):
    return [r[key] for r in _results()]


# ---- HSDP --------------------------------------------------------------------------------------

def test_hsdp_fsdp2_style_matches_unsharded_training():
    assert max(_all("hsdp_fsdp2")) < TOL


def test_hsdp_parameters_are_placed_as_fsdp2_places_them():
    for placements, meshes in zip(_all("hsdp_fsdp2_placements"), _all("hsdp_fsdp2_mesh")):
        assert placements == {"(Replicate(), Shard(dim=0))"}
        assert meshes == {("replicate", "shard")}


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_hsdp_megatron_style_matches_unsharded_training(strategy):
    assert max(_all(f"hsdp_zero{strategy}")) < TOL


def _reduce_bytes(groups) -> tuple[int, int]:
    """(shard-dimension reduction bytes, outer all-reduce bytes) one
    synchronising backward moves: a sharded group reduce-scatters its
    unsharded gradient buffer (W x S elements) over the shard dimension and
    all-reduces its chunk (S) across replicas; a replicated one all-reduces
    its whole buffer on both."""
    inner = sum(full * item for _s, item, _sharded, full, _p in groups)
    outer = sum((s if sharded else full) * item for s, item, sharded, full, _p in groups)
    return inner, outer


def test_hsdp_bytes_per_step_per_dimension_follow_the_formula():
    comm, groups = _all("hsdp_fsdp2_comm")[0], _all("hsdp_fsdp2_groups")[0]
    inner, outer = _reduce_bytes(groups)
    assert comm["shard"]["reduce_scatter"]["bytes"] == inner
    assert comm["replicate"] == {"all_reduce": {"count": 1, "bytes": outer}}  # one coalesced all-reduce
    # Weights are gathered over the shard dimension only.
    assert set(comm) == {"shard", "replicate"} and "all_gather" not in comm["replicate"]


@pytest.mark.parametrize("mode", ["no_sync", "deferred", "requires_all_reduce"])
def test_outer_traffic_happens_once_per_step_with_gradient_accumulation(mode):
    assert max(_all(f"accum_{mode}")) < TOL
    comm, groups = _all(f"accum_{mode}_comm")[0], _all(f"accum_{mode}_groups")[0]
    inner, outer = _reduce_bytes(groups)
    # Across replicas: the formula's bytes once per step, for two microbatches.
    assert comm["dp_outer"]["all_reduce"]["bytes"] == outer
    # Inside the shard group: once per step without sync, once per microbatch otherwise.
    assert comm["dp_shard"]["reduce_scatter"]["bytes"] == inner * (1 if mode == "no_sync" else 2)


def test_syncing_every_microbatch_pays_the_outer_traffic_per_microbatch():
    """The control for the test above: without deferral the outer bytes double."""
    comm, groups = _all("accum_every_microbatch_comm")[0], _all("accum_every_microbatch_groups")[0]
    assert max(_all("accum_every_microbatch")) < TOL
    assert comm["dp_outer"]["all_reduce"]["bytes"] == 2 * _reduce_bytes(groups)[1]


def test_hsdp_persistent_memory_is_the_shard_groups():
    """HSDP keeps per rank what FSDP over the shard dimension alone keeps: the
    replicas add nothing (docs/meshes.md). fp32, per group of N unsharded and
    S = N / dp_shard sharded elements: ZeRO-1 keeps the weights and the
    gradient buffer (whose own row is the main grads), ZeRO-2 the weights and
    the main grads, ZeRO-3 its chunk (which is the main weights) and the main grads."""
    for strategy in (1, 2, 3):
        groups = _all(f"hsdp_zero{strategy}_groups")[0]
        per_group = {1: lambda s, n: 2 * n, 2: lambda s, n: n + s, 3: lambda s, n: 2 * s}[strategy]
        expected = sum(4 * per_group(s, n) for s, _item, _sharded, n, _p in groups)
        assert _all(f"hsdp_zero{strategy}_persistent")[0] == expected
        assert all(n == 2 * s for s, _i, _sh, n, _p in groups)  # chunks over dp_shard (2), not over all 4 ranks


# ---- HFSDP ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["hfsdp", "hfsdp_accum"])
def test_hfsdp_matches_unsharded_training(name):
    assert max(_all(name)) < TOL


def test_hfsdp_pieces_are_placed_over_both_dimensions():
    """Inner chunk, then its outer piece: nested Shard(0) on the (shard,
    outer) mesh, for any size -- 5 rows of the head included."""
    placements, meshes = _all("hfsdp_placements")[0], _all("hfsdp_meshes")[0]
    assert set(placements.values()) == {"(Shard(dim=0), Shard(dim=0))"}
    assert meshes == {("dp_shard", "dp_outer")}


@pytest.mark.parametrize("name", ["hfsdp", "hfsdp_accum"])
def test_hfsdp_outer_traffic_is_one_reduce_scatter_and_one_gather_per_step(name):
    comm, groups = _all(f"{name}_comm")[0], _all(f"{name}_groups")[0]
    hybrid = [g for g in groups if g[4] is not None]
    assert hybrid == groups  # every parameter is split across the outer dimension
    outer = comm["dp_outer"]
    # The pieces table of a hybrid group is outer x pieces elements, once each way per step
    # (one collective per hybrid group), however many microbatches; no all-reduce at all.
    table = sum(2 * p * item for _s, item, _sh, _f, p in hybrid)
    assert outer == {"reduce_scatter": {"count": len(hybrid), "bytes": table},
                     "all_gather": {"count": len(hybrid), "bytes": table}}


def test_hfsdp_persistent_memory_follows_the_formula():
    """(weights) / inner + (main weights + main grads) / (inner x outer) for
    hybrid groups; HSDP ZeRO-3 for the rest (docs/meshes.md)."""
    groups = _all("hfsdp_groups")[0]
    expected = sum(4 * (s + 2 * p) if p is not None else 4 * 2 * s for s, _i, _sh, _f, p in groups)
    assert _all("hfsdp_persistent")[0] == expected
    for s, _i, _sh, _f, p in groups:
        if p is not None:
            assert p <= s // 2 + 8 * 4  # half the chunk, up to alignment


# ---- context parallel ---------------------------------------------------------------------------

def test_context_parallel_shards_over_the_flattened_dimension():
    assert max(_all("cp")) < TOL
    assert _all("cp_shard_size")[0] == {WORLD}
    comm = _all("cp_comm")[0]
    # dp_shard_cp spans every rank here, so torch reuses the default group: "world".
    assert set(comm) == {"world"} and comm["world"]["reduce_scatter"]["count"] == 1


# ---- tensor parallel ----------------------------------------------------------------------------

@pytest.mark.parametrize("style", ["fsdp2", "megatron"])
def test_tensor_parallel_matches_unsharded_training(style):
    assert max(_all(f"tp_{style}")) < TOL


@pytest.mark.parametrize("style", ["fsdp2", "megatron"])
def test_tensor_parallel_placements_compose(style):
    placements = _all(f"tp_{style}_placements")[0]
    # Column-parallel: TP already splits dim 0, so FSDP's chunk of it is strided.
    assert placements["blocks.0.w1.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    # Row-parallel: TP splits dim 1; FSDP chunks dim 0.
    assert placements["blocks.0.w2.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert placements["blocks.0.w2.bias"] == "(Shard(dim=0), Replicate())"
    # Not tensor parallel: data-parallel only.
    assert placements["head.weight"] == "(Shard(dim=0),)"


@pytest.mark.parametrize("style", ["fsdp2", "megatron"])
def test_tensor_parallel_gradients_are_reduced_over_dp_only(style):
    comm, groups = _all(f"tp_{style}_comm")[0], _all(f"tp_{style}_groups")[0]
    assert set(comm) == {"dp"}
    assert comm["dp"]["reduce_scatter"]["bytes"] == sum(f * item for _s, item, _sh, f, _p in groups)


# ---- expert parallel ----------------------------------------------------------------------------

def test_expert_parallel_matches_unsharded_training():
    assert max(_all("ep")) < TOL
    assert _all("ep_expert_mesh_sizes")[0] == {2}  # experts sharded over their own data-parallel group


@pytest.mark.parametrize("layout,ranks", [("cp_memory", 4), ("tp_fsdp2_memory", 2), ("tp_megatron_memory", 2),
                                          ("ep_memory", None)])
def test_persistent_memory_of_composed_layouts_follows_the_formula(layout, ranks):
    """ZeRO-3 keeps per group its chunk (the main weights, fp32) and the main
    grads: 2 x S x 4 bytes, S = N / ranks (tensor-parallel: N counts the
    local TP shard; experts: their own data-parallel group of 2)."""
    persistent, groups = _all(layout)[0]
    assert persistent == sum(2 * 4 * s for s, _i, _sh, _n, _p in groups)
    for s, _i, _sh, n, _p in groups:
        assert n == s * (ranks or n // s)
