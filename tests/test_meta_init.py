"""Models built on the meta device: materialised unit by unit, each rank
keeping its shard, equal to the same model built normally."""

from __future__ import annotations

import dataclasses
import resource

import pytest
import torch
from torch import nn

import flatfsdp
from flatfsdp.models.gpt import GPT, TransformerBlock, lm_loss
from harness import run_ranks
from training import CFG, batches, global_mean, local_slice, make_optimizer

BIG = dataclasses.replace(CFG, n_layer=8, d_model=256, vocab_size=256)
SEED = 7


def _values(model):
    # Deferred initialisation runs at a unit's first use (here: unshard);
    # before it, state_dict() reports meta placeholders, as FSDP2 does.
    for unit in [m for m in model.modules() if isinstance(m, flatfsdp.FSDPModule)]:
        unit.unshard()
        unit.reshard()
    state = model.state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in state.items()}


def _one_call(cfg, strategy="optim_grads_params"):
    with torch.device("meta"):
        model = GPT(cfg)
    opt = make_optimizer("adamw", model.named_parameters())
    return flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[TransformerBlock], zero_dp_strategy=strategy,
                                init_model_with_meta_device=True, meta_init_seed=SEED)


def _per_module(cfg):
    with torch.device("meta"):
        model = GPT(cfg)
    for block in model.blocks:
        flatfsdp.fully_shard(block, meta_init_seed=SEED)
    flatfsdp.fully_shard(model, meta_init_seed=SEED)
    return model, make_optimizer("adamw", model.named_parameters())


def _reference(cfg):
    return flatfsdp.reset_parameters(GPT(cfg), SEED)


def meta_worker(rank, world):
    ref = _values(_reference(CFG))
    out = {"ref": ref}
    for name, build in (("one_call", lambda: _one_call(CFG)), ("one_call_zero1", lambda: _one_call(CFG, "optim")),
                        ("per_module", lambda: _per_module(CFG))):
        model, _ = build()
        out[name] = _values(model)
    # Training from a meta-initialised model follows the reference.
    model, opt = _one_call(CFG)
    ref_model = _reference(CFG)
    ref_opt = make_optimizer("adamw", ref_model.named_parameters())
    diffs = []
    for x in batches(5):
        lx = local_slice(x, rank, world)
        loss = lm_loss(model(lx[:, :-1]), lx[:, 1:])
        loss.backward(), opt.step(), opt.zero_grad()
        ref_loss = lm_loss(ref_model(x[:, :-1]), x[:, 1:])
        ref_loss.backward(), ref_opt.step(), ref_opt.zero_grad()
        diffs.append(abs(global_mean(loss) - ref_loss.item()))
    out["train_diff"] = max(diffs)
    return out


def memory_worker(rank, world):
    """Peak RSS while a meta model is sharded and initialised, against the
    whole model's size and what the rank keeps."""
    full_bytes = sum(p.numel() * 4 for p in GPT(dataclasses.replace(BIG)).parameters())
    # `import flatfsdp` binds the engine lazily, and the first sharding imports
    # more (torch's compiler stack): shard a tiny model first, or the mark
    # counts those imports (tens of MB) as this initialisation.
    _values(_one_call(CFG)[0])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model, _ = _one_call(BIG)
    for unit in [m for m in model.modules() if isinstance(m, flatfsdp.FSDPModule)]:
        unit.unshard()  # runs the deferred initialisation, one unit at a time
        unit.reshard()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"peak": peak, "persistent": flatfsdp.persistent_buffer_bytes(model), "full": full_bytes,
            "unit": sum(p.numel() * 4 for p in GPT(BIG).blocks[0].parameters())}


@pytest.fixture(scope="module")
def results():
    return run_ranks(meta_worker, 2)


@pytest.mark.parametrize("variant", ["one_call", "one_call_zero1", "per_module"])
def test_meta_initialised_model_equals_the_normally_built_one(results, variant):
    for out in results:
        assert out[variant].keys() == out["ref"].keys()
        for key, value in out["ref"].items():
            assert torch.equal(out[variant][key], value), (variant, key)


def test_meta_initialised_model_trains_like_the_reference(results):
    assert all(out["train_diff"] < 1e-5 for out in results)


def test_no_rank_ever_holds_the_whole_model(monkeypatch):
    # Fresh rank processes, so the RSS high-water mark is this test's; large
    # blocks straight from mmap, so freed memory leaves RSS (glibc would
    # otherwise keep it and the mark would count reuse as growth).
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    for out in run_ranks(memory_worker, 4, fresh_interpreter=True):
        # What a rank keeps, plus a few transient copies of one unit -- far
        # below keeping plus one whole model, which materialising first costs.
        assert out["peak"] < out["persistent"] + 4 * out["unit"] + 8 * 2**20, out
        assert out["persistent"] + 4 * out["unit"] < out["persistent"] + out["full"], out


def test_module_without_reset_parameters_is_named():
    message = run_ranks(_no_reset_worker, 1)[0]
    assert message and "'1'" in message and "_Scale" in message and "reset_parameters" in message


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.gain


def _no_reset_worker(rank, world):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _Scale())
    flatfsdp.fully_shard(model)  # fine: a pretrained load could still fill it (flatfsdp.load_pretrained)
    try:
        model(torch.ones(1, 4))  # initialisation runs now, and needs reset_parameters()
    except ValueError as err:
        return str(err)
    return None


def test_parameter_replaced_after_sharding_needs_no_reset_parameters():
    """FSDP2's lazy-init case: a meta parameter of a module without
    reset_parameters() is given its value by assignment after sharding; the
    unit takes that value, and the rest is initialised as the reference."""
    values, reference = run_ranks(_replaced_worker, 2)[0]
    assert torch.equal(values["1.gain"], torch.full((4,), 3.0))
    for key in ("0.weight", "0.bias"):
        assert torch.equal(values[key], reference[key]), key


def _replaced_worker(rank, world):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _Scale())
    flatfsdp.fully_shard(model, meta_init_seed=SEED)
    model[1].gain = nn.Parameter(torch.full((4,), 3.0))
    model(torch.ones(1, 4))
    model.reshard()
    reference = flatfsdp.reset_parameters(nn.Sequential(nn.Linear(4, 4), nn.Identity()), SEED)
    return _values(model), _values(reference)


def test_values_written_after_sharding_are_not_reinitialised():
    """to_empty on an unsharded parent, then the user's own init of one
    parameter: that value survives the first forward; the rest of the meta
    model is initialised by reset_parameters() as usual."""
    values, reference = run_ranks(_written_worker, 2)[0]
    assert torch.equal(values["0.weight"], torch.full((4, 4), 0.25))
    assert torch.equal(values["0.bias"], reference["bias"])
    assert torch.equal(values["1.weight"], reference["weight"]) and torch.equal(values["1.bias"], reference["bias"])


def _written_worker(rank, world):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for layer in model:
        flatfsdp.fully_shard(layer, meta_init_seed=SEED)  # two roots, each named "" as a model of its own
    model.to_empty(device="cpu")  # a plain parent: each unit is converted through _apply, not to_empty
    nn.init.constant_(model[0].weight, 0.25)
    model(torch.ones(1, 4))
    for layer in model:
        layer.reshard()
    return _values(model), _values(flatfsdp.reset_parameters(nn.Linear(4, 4), SEED))


def _unseeded_worker(rank, world):
    """No seed anywhere: torch draws each process's initial seed at random."""
    seed = torch.initial_seed()
    with torch.device("meta"):
        model = GPT(CFG)
    for block in model.blocks:
        flatfsdp.fully_shard(block)
    flatfsdp.fully_shard(model)
    return seed, _values(model)


def test_unseeded_meta_init_follows_the_first_rank_seed():
    """Every rank initialises its chunks from the same seed (the first rank's),
    so the sharded model is one consistent model: reset_parameters with that
    seed in one process rebuilds it exactly."""
    (seed0, values), (seed1, _) = run_ranks(_unseeded_worker, 2)
    assert seed0 != seed1  # the premise: the processes' own seeds differ
    reference = flatfsdp.reset_parameters(GPT(CFG), seed0 & 0x7FFF_FFFF_FFFF_FFFF)
    for key, value in reference.state_dict().items():
        assert torch.equal(values[key], value), key


def _meta_tensor_parallel_worker(rank, world):
    """Tensor-parallel DTensors built on the meta device: sharded with their
    local shards made real, never initialised by flatfsdp (it names them), and
    filled by the user then declared filled, they compute the right output."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))

    def build():
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return flatfsdp.fully_shard(model, device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp",
                                    init_model_with_meta_device=True)

    model = build()
    try:
        model(torch.ones(2, 8))
        refused = None
    except NotImplementedError as err:
        refused = str(err)

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    model = build()
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = reference.get_parameter(name).detach()
            param.copy_(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None))
    flatfsdp.mark_initialized(model)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    return refused, torch.allclose(model(x), reference(x), atol=1e-6)


def test_meta_tensor_parallel_parameters_are_filled_not_initialised():
    (refused, matches), _ = run_ranks(_meta_tensor_parallel_worker, 2)
    assert refused and "parameter '0.weight' is tensor-parallel" in refused and "mark_initialized" in refused
    assert matches
