"""FSDP2's API surface (issue 17): each argument and FSDPModule method, checked
for parity against an unsharded reference trained on the global batch, on 2
real ranks. Every scenario runs in one pair of processes (spawning is the slow
part); each test asserts on its own scenario's result."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run_ranks

DIM = 16
TOL = 1e-5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x):
        return torch.relu(self.lin(x))

    def encode(self, x):
        """A method other than forward that a parent calls directly."""
        return self.lin(x) * 0.5


class Net(nn.Module):
    def __init__(self, use_encode: bool = False):
        super().__init__()
        self.emb = nn.Linear(DIM, DIM, bias=False)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, 8)
        self.use_encode = use_encode

    def forward(self, x, skip_head: bool = False, skip_block: int | None = None):
        h = self.emb(x)
        for i, block in enumerate(self.blocks):
            if i == skip_block:
                continue  # routing: this input does not use the block
            h = block.encode(h) if self.use_encode and i == 0 else block(h)
        h = self.norm(h)
        return h if skip_head else self.head(h)


def _net(**kw) -> Net:
    torch.manual_seed(0)
    return Net(**kw)


def _batches(n: int, size: int = 4):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(size, DIM, generator=gen) for _ in range(n)]


def _local(x):
    per = x.shape[0] // dist.get_world_size()
    return x[dist.get_rank() * per:(dist.get_rank() + 1) * per]


def _shard(model: Net, fully_shard, *, group_norm_head=False, **kw) -> Net:
    fully_shard(model.emb, **kw)
    for block in model.blocks:
        fully_shard(block, **kw)
    if group_norm_head:
        fully_shard([model.norm, model.head], **kw)
    fully_shard(model, **kw)
    return model


def _max_param_diff(model, ref) -> float:
    diffs = []
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        diffs.append((full.detach().double() - q.detach().double()).abs().max().item())
    return max(diffs)


def _train(model, ref, steps=3, *, before_step=None, microbatches=1, forward=None):
    """Adam on both; the sharded model sees its slice of each global batch."""
    forward = forward or (lambda m, x: m(x))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for x in _batches(steps):
        for i, mb in enumerate(x.chunk(microbatches)):
            if before_step:
                before_step(model, i == microbatches - 1)
            (forward(model, _local(mb)).pow(2).mean() / microbatches).backward()
            (forward(ref, mb).pow(2).mean() / microbatches).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    return _max_param_diff(model, ref)


def _scenarios(rank, world):
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule as TorchFSDPModule, OffloadPolicy
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    import flatfsdp
    from flatfsdp import fully_shard

    out = {}

    def fresh(**kw):
        model = _net(**kw)
        return model, copy.deepcopy(model)

    # Arguments of fully_shard.
    for value in (True, False, None, 1, 2):
        model, ref = fresh()
        out[f"reshard_after_forward={value}"] = _train(_shard(model, fully_shard, reshard_after_forward=value), ref)

    model, ref = fresh()
    out["grouped"] = _train(_shard(model, fully_shard, group_norm_head=True), ref)
    out["grouped_is_one_unit"] = model.norm._flatfsdp_state is model.head._flatfsdp_state

    model, ref = fresh()
    largest = lambda p: Shard(max(range(p.ndim), key=lambda d: p.shape[d])) if p.ndim else None  # noqa: E731
    fully_shard(model.head, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    for unit in (model.emb, *model.blocks):
        fully_shard(unit, shard_placement_fn=largest)
    fully_shard(model)
    out["placement_fn_head"] = [str(p.placements) for p in model.head.parameters()]
    out["placement_fn"] = _train(model, ref)

    model, ref = fresh()
    out["offload_policy"] = _train(_shard(model, fully_shard, offload_policy=CPUOffloadPolicy()), ref)
    model, ref = fresh()
    out["offload_none"] = _train(_shard(model, fully_shard, offload_policy=OffloadPolicy()), ref)

    model, ref = fresh()
    ignored = {model.head.bias}
    _shard(model, fully_shard, ignored_params=ignored)
    out["ignored_is_plain"] = not hasattr(model.head.bias, "placements")
    # An ignored parameter is the user's: no reduction, so average it by hand.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x in _batches(2):
        model(_local(x)).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        dist.all_reduce(model.head.bias.grad)
        model.head.bias.grad /= world
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    out["ignored"] = _max_param_diff(model, ref)

    # Frozen after sharding (the FSDP2 suite's frozen case): the unit must
    # stop training it, as the reference does.
    model, ref = fresh()
    _shard(model, fully_shard)
    for p in (*model.emb.parameters(), *model.blocks[1].parameters()):
        p.requires_grad_(False)
    for p in (*ref.emb.parameters(), *ref.blocks[1].parameters()):
        p.requires_grad_(False)
    out["frozen_after_sharding"] = _train(model, ref)

    # FSDPModule methods.
    def accumulate(m, last):
        m.set_requires_gradient_sync(last)
        m.set_is_last_backward(last)
        m.set_reshard_after_backward(last)
    model, ref = fresh()
    out["grad_accumulation"] = _train(_shard(model, fully_shard, reshard_after_forward=False), ref,
                                      before_step=accumulate, microbatches=2)

    def all_reduce_off(m, last):
        m.set_requires_all_reduce(False)
    model, ref = fresh()
    out["requires_all_reduce_1d"] = _train(_shard(model, fully_shard), ref, before_step=all_reduce_off)

    model, ref = fresh()
    _shard(model, fully_shard)
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 3])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - 2):i][::-1])
    out["explicit_prefetch"] = _train(model, ref)

    model, ref = fresh()
    _shard(model, fully_shard)
    model.emb.set_unshard_in_backward(False)
    for p in model.emb.parameters():  # its gradient needs the input only; freeze to make that true
        p.requires_grad_(False)
    for p in ref.emb.parameters():
        p.requires_grad_(False)
    out["unshard_in_backward_false"] = _train(model, ref)

    model, ref = fresh()
    _shard(model, fully_shard)
    model.set_reduce_scatter_max_input_buffers(3)
    out["max_input_buffers"] = _train(model, ref)
    bad = []
    for value in (0, 2.5, True):
        try:
            model.set_reduce_scatter_max_input_buffers(value)
        except (TypeError, ValueError) as e:
            bad.append(type(e).__name__)
    out["max_input_buffers_errors"] = bad

    model, ref = fresh()
    _shard(model, fully_shard)
    # Each unit keeps its own factor (FSDP2: the root's does not reach the
    # units below it): the root's own parameters (norm, head) are summed,
    # blocks.1's divided by twice the world, the rest averaged.
    model.set_gradient_divide_factor(1.0)
    model.blocks[1].set_gradient_divide_factor(2.0 * world)
    x = _batches(1)[0]
    model(_local(x)).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()

    def scale(name: str, root: float, block1: float) -> float:
        return root if name.startswith(("norm.", "head.")) else block1 if name.startswith("blocks.1.") else 1.0

    out["divide_factor"] = max((p.grad.full_tensor() - q.grad * scale(n, world, 0.5)).abs().max().item()
                               for (n, p), q in zip(model.named_parameters(), ref.parameters()))

    model, ref = fresh()
    _shard(model, fully_shard)
    calls = []
    model.blocks[1].set_all_reduce_hook(lambda g: (calls.append(g.numel()), g.mul_(3.0)))
    model(_local(x)).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    out["all_reduce_hook"] = max((p.grad.full_tensor() - q.grad * scale(n, 1.0, 3.0)).abs().max().item()
                                 for (n, p), q in zip(model.named_parameters(), ref.parameters()))
    out["all_reduce_hook_calls"] = len(calls)

    model, ref = fresh()
    _shard(model, fully_shard)
    handle = model.blocks[0].unshard(async_op=True)
    out["handle_type"] = type(handle).__name__
    handle.wait()
    out["unsharded_is_plain"] = not hasattr(model.blocks[0].lin.weight, "placements")
    model.blocks[0].reshard()
    out["resharded_is_dtensor"] = hasattr(model.blocks[0].lin.weight, "placements")
    out["unshard_async"] = _train(model, ref)

    model, ref = fresh(use_encode=True)
    _shard(model, fully_shard)
    flatfsdp.register_fsdp_forward_method(model.blocks[0], "encode")
    out["forward_method"] = _train(model, ref)

    model, ref = fresh()
    _shard(model, fully_shard)
    model.to(torch.float64)
    ref.to(torch.float64)
    out["to_float64_dtypes"] = sorted({str(p.dtype) for p in model.parameters()} |
                                      {str(p.to_local().dtype) for p in model.parameters()})
    out["to_float64"] = _train(model, ref, forward=lambda m, x: m(x.double()))

    model, ref = fresh()
    _shard(model, fully_shard)
    original = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    model.to_empty(device="cpu")
    with torch.no_grad():  # re-initialise the sharded parameters in place, as after meta-device construction
        for n, p in model.named_parameters():
            p.copy_(distribute_tensor(original[n], p.device_mesh, p.placements))
    out["to_empty"] = _train(model, ref)

    # FSDP2's meta-device recipe: build on meta, shard, to_empty, then the
    # model's own initialisation -- which must survive the first forward.
    model, ref = fresh()
    with torch.device("meta"):
        meta = Net()
    _shard(meta, fully_shard)
    meta.to_empty(device="cpu")
    with torch.no_grad():
        for (n, p), q in zip(meta.named_parameters(), ref.parameters()):
            p.copy_(distribute_tensor(q.detach(), p.device_mesh, p.placements))
    out["meta_to_empty_then_init"] = _train(meta, ref)

    # A parameter replaced after sharding, before the first forward (FSDP2
    # shards the new value at lazy init): a plain tensor on the root unit, and
    # a DTensor computed from a sharded weight on a block.
    model, ref = fresh()
    _shard(model, fully_shard)
    gen = torch.Generator().manual_seed(5)
    new_norm = torch.randn(DIM, generator=gen)
    model.norm.weight = nn.Parameter(new_norm.clone())
    ref.norm.weight = nn.Parameter(new_norm.clone())
    with torch.no_grad():
        new_bias = nn.Parameter(torch.linalg.norm(model.blocks[0].lin.weight, dim=1))
        model.blocks[0].lin.bias = new_bias
        ref.blocks[0].lin.bias = nn.Parameter(torch.linalg.norm(ref.blocks[0].lin.weight, dim=1))
    stale = torch.optim.SGD(model.parameters(), lr=0.1)  # holds the plain norm.weight
    try:
        model(_local(_batches(1)[0]))
        out["replaced_stale_optimizer"] = ""
    except ValueError as e:
        out["replaced_stale_optimizer"] = str(e)
    del stale
    out["replaced_after_sharding"] = _train(model, ref)
    out["replaced_is_sharded"] = (model.blocks[0].lin.bias is new_bias and isinstance(new_bias, DTensor)
                                  and isinstance(model.norm.weight, DTensor))
    model, _ = fresh()
    _shard(model, fully_shard)
    model.blocks[2].lin.bias = nn.Parameter(torch.zeros(DIM + 1))
    try:
        model(_local(_batches(1)[0]))
        out["replaced_bad_shape"] = ""
    except ValueError as e:
        out["replaced_bad_shape"] = str(e)

    model, ref = fresh()
    _shard(model, fully_shard)

    def boom(*a, **k):
        raise RuntimeError("boom")
    model.blocks[1].forward = boom
    try:
        model(_local(_batches(1)[0]))
    except RuntimeError:
        pass
    del model.blocks[1].forward
    model.reset_iter_state()
    out["after_reset_iter_state"] = _train(model, ref)

    out["isinstance_torch"] = isinstance(model, TorchFSDPModule) and isinstance(model, flatfsdp.FSDPModule)

    # Ranks that use different parameters of one unit: rank r's data skips
    # block r (blocks in the root unit), so block 0 has no gradient on rank 0.
    model, ref = fresh()
    fully_shard(model.emb)
    fully_shard(model)
    model.set_reduce_scatter_unused_params(True)
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    for x in _batches(3):
        per = x.shape[0] // world
        model(_local(x), skip_block=rank).pow(2).mean().backward()
        (sum(ref(x[r * per:(r + 1) * per], skip_block=r).pow(2).mean() for r in range(world)) / world).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    out["reduce_scatter_unused_params"] = _max_param_diff(model, ref)
    model.head.bias.requires_grad_(False)  # frozen after sharding: no zero gradient is made up for it
    model(_local(_batches(1)[0]), skip_block=rank).pow(2).mean().backward()
    out["unused_params_skip_frozen"] = model.head.bias.grad is None and model.head.weight.grad is not None

    # FSDP2's allocation and communicator hints are accepted and change no
    # value; something that is not an FSDP2 Comm is refused, naming the unit.
    model, ref = fresh()
    _shard(model, fully_shard)
    model.set_force_sum_reduction_for_comms(True)
    model.set_allocate_memory_from_process_group_for_comm(True)
    model.set_symm_mem_for_comm()
    model.set_separate_reduce_scatter_group(True)
    out["accepted_hints"] = _train(model, ref)
    refused = []
    for method in ("set_custom_all_gather", "set_custom_reduce_scatter"):
        try:
            getattr(model.blocks[1], method)(object())
        except TypeError as e:
            refused.append(str(e))
    out["custom_comms_refused"] = refused
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_scenarios, 2)


PARITY = ["reshard_after_forward=True", "reshard_after_forward=False", "reshard_after_forward=None",
          "reshard_after_forward=1", "reshard_after_forward=2", "grouped", "placement_fn", "offload_policy",
          "offload_none", "ignored", "frozen_after_sharding", "grad_accumulation", "requires_all_reduce_1d",
          "explicit_prefetch", "unshard_in_backward_false", "max_input_buffers", "unshard_async",
          "forward_method", "to_float64", "to_empty", "after_reset_iter_state", "reduce_scatter_unused_params",
          "accepted_hints", "meta_to_empty_then_init", "replaced_after_sharding"]


@pytest.mark.parametrize("scenario", PARITY)
def test_trains_like_the_unsharded_reference(results, scenario):
    for rank, result in enumerate(results):
        assert result[scenario] < TOL, (scenario, rank, result[scenario])


def test_grouped_modules_share_one_unit(results):
    assert results[0]["grouped_is_one_unit"]


def test_shard_placement_fn_places_parameters(results):
    assert results[0]["placement_fn_head"] == ["(Shard(dim=1),)", "(Shard(dim=0),)"]


def test_ignored_params_stay_plain_tensors(results):
    assert results[0]["ignored_is_plain"]


def test_gradient_divide_factor_and_all_reduce_hook(results):
    assert results[0]["divide_factor"] < TOL
    assert results[0]["all_reduce_hook"] < TOL
    assert results[0]["all_reduce_hook_calls"] == 1  # blocks.1 only: one group, one reduction


def test_unshard_returns_a_handle_and_reshard_restores_dtensors(results):
    r = results[0]
    assert r["handle_type"] == "UnshardHandle"
    assert r["unsharded_is_plain"] and r["resharded_is_dtensor"]


def test_to_float64_converts_sharded_parameters(results):
    assert results[0]["to_float64_dtypes"] == ["torch.float64"]


def test_max_input_buffers_validation(results):
    assert results[0]["max_input_buffers_errors"] == ["ValueError", "TypeError", "TypeError"]


def test_units_are_torch_fsdp_modules(results):
    assert results[0]["isinstance_torch"]


def test_replaced_parameters_are_sharded_or_refused_naming_them(results):
    assert results[0]["replaced_is_sharded"]
    message = results[0]["replaced_bad_shape"]
    assert "'blocks.2.lin.bias'" in message or "'lin.bias'" in message, message
    assert "(17,)" in message and "(16,)" in message, message
    stale = results[0]["replaced_stale_optimizer"]
    assert "'norm.weight' (a plain tensor assigned after fully_shard" in stale, stale


def test_unused_params_leave_frozen_parameters_without_gradient(results):
    assert all(r["unused_params_skip_frozen"] for r in results)


def test_a_custom_collective_that_is_not_a_comm_is_refused_naming_the_unit(results):
    refused = results[0]["custom_comms_refused"]
    assert len(refused) == 2 and all("unit 'blocks.1'" in message and "allocate" in message for message in refused)


def _profiled_step(rank, world):
    from torch.profiler import ProfilerActivity, profile

    from flatfsdp import fully_shard

    model = _shard(_net(), fully_shard)
    x = _local(_batches(1)[0])
    model(x).sum().backward()  # the first step records the order prefetch follows
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
    return sorted({e.name for e in prof.events() if e.name.startswith("flatfsdp::")})


def test_profiler_labels_name_every_unit_and_phase():
    names = set(run_ranks(_profiled_step, 2)[0])
    for unit in ("emb", "blocks.0", "blocks.1", "blocks.2", "<root>"):
        for phase in ("pre_forward", "post_forward", "pre_backward", "post_backward"):
            assert f"flatfsdp::{phase} ({unit})" in names, (phase, unit, sorted(names))
    assert any(n.startswith("flatfsdp::unshard (") for n in names)
    assert {"flatfsdp::finish_backward", "flatfsdp::reduce_scatter"} <= names
