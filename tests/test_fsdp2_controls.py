"""torch 2.15's FSDP2 controls (issue 28): manual backward finalization
(``set_manual_backward_finalization`` + ``finalize_backward``, sync and
async), ``set_keep_unsharded_storage`` and ``MixedPrecisionPolicy
(param_dtype_override_fn=...)``. flatfsdp's methods work on every supported
torch; where the installed torch has them (2.15), stock FSDP2 runs the same
script beside flatfsdp and both must agree. One pair of ranks for everything."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run_ranks

DIM = 8
TOL = 1e-6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x):
        return self.norm(torch.tanh(self.lin(x)))


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


def _batches():
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(8, DIM, generator=gen) for _ in range(2)]


def _local(x):
    half = x.shape[0] // 2
    return x[dist.get_rank() * half:(dist.get_rank() + 1) * half]


def _shard(fully_shard, policy_for=None, **kw) -> nn.Sequential:
    model = _net()
    if policy_for is not None:
        kw["mp_policy"] = policy_for(model)
    for block in model:
        fully_shard(block, **kw)
    return fully_shard(model, **kw)


def _full(model) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _reference() -> list[torch.Tensor]:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in _batches():
        for mb in x.chunk(2):
            (model(mb).pow(2).mean() / 2).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _manual_finalization(fully_shard, async_op: bool) -> dict:
    """Two microbatches per step, synchronised only on the second, finalized by hand."""
    model = _shard(fully_shard)
    model.set_manual_backward_finalization(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict = {}
    for step, x in enumerate(_batches()):
        for i, mb in enumerate(x.chunk(2)):
            model.set_requires_gradient_sync(i == 1)
            (model(_local(mb)).pow(2).mean() / 2).backward()
        handle = model.finalize_backward(async_op=async_op)
        if async_op:
            out["handle_type"] = type(handle).__mro__[-2].__module__ + "." + type(handle).__mro__[-2].__name__
            if step == 0:
                try:
                    model(_local(x))
                except RuntimeError as error:
                    out["forward_before_wait"] = str(error)
            handle.wait()
        else:
            out["returns"] = handle
        opt.step()
        opt.zero_grad()
    out["params"] = _full(model)
    return out


def _misuse(fully_shard) -> list[str]:
    errors = []
    model = _shard(fully_shard)
    model(_local(_batches()[0])).sum().backward()
    for call in (lambda: model.finalize_backward(),  # manual finalization is off
                 lambda: model[0].set_manual_backward_finalization(True)):  # not the root
        try:
            call()
            errors.append("no error")
        except RuntimeError as error:
            errors.append(str(error))
    return errors


def _keep_storage(fully_shard, keep: bool) -> dict:
    model = _shard(fully_shard, reshard_after_forward=True)
    model.set_keep_unsharded_storage(keep)
    seen = []
    model[0].lin.register_forward_hook(lambda m, i, o: seen.append(m.weight.data_ptr()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in _batches():
        model(_local(x)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    held = None
    if isinstance(model, __import__("flatfsdp").FSDPModule):  # unsharded bytes still held between steps
        from flatfsdp import allocated_buffer_bytes, persistent_buffer_bytes
        held = allocated_buffer_bytes(model) - persistent_buffer_bytes(model)
    return dict(same_address=len(set(seen)) == 1, params=_full(model), held=held)


def _override(fully_shard, MixedPrecisionPolicy) -> dict:
    def policy_for(model):  # the norms stay in fp32
        norms = {id(p) for block in model for p in block.norm.parameters()}
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                    param_dtype_override_fn=lambda p: p.dtype if id(p) in norms else None)

    model = _shard(fully_shard, policy_for)
    dtypes = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.LayerNorm)):
            module.register_forward_hook(lambda m, i, o, name=name: dtypes.update(
                {f"{name}.{n}": str(p.dtype) for n, p in m.named_parameters()}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in _batches():
        model(_local(x)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return dict(dtypes=dtypes, params=_full(model))


def _bad_override(MixedPrecisionPolicy) -> str:
    from flatfsdp import fully_shard
    try:
        fully_shard(_net(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                           param_dtype_override_fn=lambda p: torch.float16))
    except ValueError as error:
        return str(error)
    return "no error"


def _worker(rank, world):
    import torch.distributed.fsdp as torch_fsdp

    import flatfsdp

    doors = {"flatfsdp": (flatfsdp.fully_shard, flatfsdp.MixedPrecisionPolicy)}
    if hasattr(torch_fsdp.FSDPModule, "finalize_backward"):  # torch 2.15: stock FSDP2 beside it
        doors["fsdp2"] = (torch_fsdp.fully_shard, torch_fsdp.MixedPrecisionPolicy)
    out = {}
    for door, (fully_shard, policy_cls) in doors.items():
        out[door] = dict(sync=_manual_finalization(fully_shard, False), async_=_manual_finalization(fully_shard, True),
                         misuse=_misuse(fully_shard), keep=_keep_storage(fully_shard, True),
                         free=_keep_storage(fully_shard, False),
                         override=_override(fully_shard, policy_cls) if door == "flatfsdp" or hasattr(
                             policy_cls, "__dataclass_fields__") and "param_dtype_override_fn" in
                         policy_cls.__dataclass_fields__ else None)
    out["bad_override"] = _bad_override(flatfsdp.MixedPrecisionPolicy)
    if "fsdp2" in doors:  # torch's own policy class, read by flatfsdp
        out["flatfsdp_with_torch_policy"] = _override(flatfsdp.fully_shard, torch_fsdp.MixedPrecisionPolicy)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, 2), _reference()


def _max_diff(a, b) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("mode", ["sync", "async_"])
def test_manual_finalization_trains_like_the_reference_and_fsdp2(results, mode):
    ranks, ref = results
    for r in ranks:
        import torch.distributed.fsdp as torch_fsdp
        assert ("fsdp2" in r) == hasattr(torch_fsdp.FSDPModule, "finalize_backward")
        assert _max_diff(r["flatfsdp"][mode]["params"], ref) < TOL
        if "fsdp2" in r:
            assert _max_diff(r["fsdp2"][mode]["params"], ref) < TOL
            assert _max_diff(r["flatfsdp"][mode]["params"], r["fsdp2"][mode]["params"]) < TOL


def test_async_finalization_returns_a_handle_and_guards_the_next_forward(results):
    import torch.distributed.fsdp as torch_fsdp

    for r in results[0]:
        flat = r["flatfsdp"]
        assert flat["sync"]["returns"] is None
        assert "wait" in flat["async_"]["forward_before_wait"], flat["async_"]
        if hasattr(torch_fsdp, "GradientReductionHandle"):  # 2.15: flatfsdp's handle is torch's type
            assert flat["async_"]["handle_type"] == r.get("fsdp2", flat)["async_"]["handle_type"]
            assert "forward_before_wait" in r["fsdp2"]["async_"]


def test_misuse_of_manual_finalization_is_refused_as_fsdp2_does(results):
    for r in results[0]:
        flat = r["flatfsdp"]["misuse"]
        assert "set_manual_backward_finalization(True)" in flat[0], flat
        assert "root" in flat[1] and "'0'" in flat[1], flat  # names the unit
        if "fsdp2" in r:
            assert all(message != "no error" for message in r["fsdp2"]["misuse"]), r["fsdp2"]["misuse"]


def test_keep_unsharded_storage_keeps_addresses_and_training(results):
    ranks, ref = results
    for r in ranks:
        for door in ("flatfsdp", "fsdp2"):
            if door in r:
                assert r[door]["keep"]["same_address"], door
        # 4 parameters of 8 or 8x8 floats per block, two blocks (ZeRO-3: only kept, never persistent)
        assert r["flatfsdp"]["keep"]["held"] >= 2 * (64 + 3 * 8) * 4 and r["flatfsdp"]["free"]["held"] == 0
        assert _max_diff(r["flatfsdp"]["keep"]["params"], r["flatfsdp"]["free"]["params"]) == 0
        if "fsdp2" in r:
            assert _max_diff(r["flatfsdp"]["keep"]["params"], r["fsdp2"]["keep"]["params"]) < TOL


def test_param_dtype_override_keeps_chosen_parameters_in_their_dtype(results):
    for r in results[0]:
        dtypes = r["flatfsdp"]["override"]["dtypes"]
        assert dtypes["0.lin.weight"] == "torch.bfloat16" and dtypes["1.lin.weight"] == "torch.bfloat16"
        assert dtypes["0.lin.bias"] == "torch.bfloat16" and dtypes["1.norm.weight"] == "torch.float32"
        assert dtypes["0.norm.bias"] == "torch.float32"
        if r["fsdp2"]["override"] is not None if "fsdp2" in r else False:
            assert r["fsdp2"]["override"]["dtypes"] == dtypes
            assert r["flatfsdp_with_torch_policy"]["dtypes"] == dtypes
            assert _max_diff(r["flatfsdp"]["override"]["params"], r["fsdp2"]["override"]["params"]) < 1e-5
    assert "torch.float16" in results[0][0]["bad_override"] and "'" in results[0][0]["bad_override"]
