"""CPU offload (FSDP2's ``CPUOffloadPolicy``, engine/layout/main_home.py).

No accelerator here, so the offloaded layout is built on CPU (the engine is
handed a ``HostHome`` where a CPU mesh would get the device home): main weights and
main grads in their own host buffers, the compute-dtype chunk copied in
before each gather, each reduced chunk copied out, host tensors staged
through the device for collectives -- every copy made, CPU to CPU. Checked:
training equals the unsharded reference in every strategy, with bf16 compute,
and on a hybrid mesh; and nothing the optimizer reads or writes shares memory
with what the module computes with. On a real CPU mesh the policy changes
nothing (tests/test_fsdp2_api.py)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from harness import run_ranks

DIM = 32
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*(Block() for _ in range(3)))
        self.head = nn.Linear(DIM, 4)

    def forward(self, x):
        return self.head(self.blocks(x))


CASES = [("optim", torch.float32, None), ("optim_grads", torch.float32, None),
         ("optim_grads_params", torch.float32, None), ("optim_grads_params", torch.bfloat16, None),
         ("optim", torch.bfloat16, None), ("optim_grads_params", torch.float32, "hsdp"),
         ("optim_grads_params", torch.float32, "hsdp_deferred")]


class _CollectivesOnHostMemory:
    """Records every c10d op that is handed a tensor in one of ``host`` storages:
    NCCL takes device memory only, so an offloaded host buffer must never be
    one (the engine stages it through the device)."""

    def __init__(self, host: set[int]):
        from torch.utils._python_dispatch import TorchDispatchMode

        found = self.found = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace == "c10d":
                    flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
                    if _storages([t for t in flat if isinstance(t, torch.Tensor)]) & host:
                        found.append(str(func))
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t is not None and t.numel()}


def _worker(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy

    import flatfsdp
    from flatfsdp.engine.layout.main_home import DEVICE, HostHome

    # Collectives as on an accelerator (one native collective per bucket, its
    # output handed to c10d), not gloo's pairwise exchanges: what the watch
    # below sees is then what NCCL would be given.
    os.environ["FLATFSDP_GLOO_ALGORITHM"] = "native"
    # Build the offloaded layout on this CPU-only machine (see the module docstring).
    HostHome.for_policy = staticmethod(lambda policy, device_type: HostHome(pin_memory=False)
                                       if isinstance(policy, CPUOffloadPolicy) else DEVICE)
    out = {}
    for strategy, dtype, hybrid in CASES:
        torch.manual_seed(0)
        model = Net()
        ref = copy.deepcopy(model)
        # bucket_bytes=0: every group's collective on its own buffers, as large
        # ones are (small ones would be packed into device staging first).
        kw = dict(fsdp_unit_modules=[Block], zero_dp_strategy=strategy, offload_policy=CPUOffloadPolicy(),
                  bucket_bytes=0)
        if dtype == torch.bfloat16:  # bf16 compute, fp32 main weights and reductions
            kw["mp_policy"] = flatfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if hybrid:
            kw.update(device_mesh=init_device_mesh("cpu", (world, 1), mesh_dim_names=("outer", "shard")),
                      dp_outer_dim="outer", dp_shard_dim="shard")
        if hybrid == "hsdp_deferred":  # the replicas' all-reduce waits for the optimizer step
            kw["sync_model_each_microbatch"] = False
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        model, opt = flatfsdp.fully_shard(model, opt, **kw)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        watch = _CollectivesOnHostMemory(_host_storages(model))
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(4 * world, DIM, generator=gen)
            with watch.mode:
                for micro in x.chunk(world)[rank].chunk(2):  # two microbatches
                    (model(micro).pow(2).mean() / 2).backward()
                opt.step()
            ref(x).pow(2).mean().backward()
            ref_opt.step()
            separate = _layout_is_separate(model)
            opt.zero_grad(), ref_opt.zero_grad()
        diff = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
        out[f"{strategy}/{dtype}/{hybrid}"] = (diff, separate, sorted(set(watch.found)))
        dist.barrier()
    return out


def _host_storages(model) -> set[int]:
    from flatfsdp.engine.runtime.unit_state import unit_states

    groups = [g for state in unit_states(model) for g in state.groups]
    return _storages([t for g in groups for t in (g.buffers.main, g.buffers.main_grad)])


def _layout_is_separate(model) -> bool:
    """What the optimizer reads and writes (the sharded DTensors, their grads,
    the main buffers) shares no memory with what the module computes with."""
    from flatfsdp.engine.runtime.unit_state import unit_states

    for state in unit_states(model):
        for group in state.groups:
            buffers = group.buffers
            host = _storages([buffers.main, buffers.main_grad] + [p.to_local() for p in group.sharded_params])
            device = _storages([buffers.unsharded.data, buffers.model_local,
                                buffers.grads.data if buffers.grads else None])
            if host & device or group.home.shares_device_memory:
                return False
            if any(_storages([p.to_local()]) - _storages([buffers.main]) for p in group.sharded_params):
                return False
    return True


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, 2)


@pytest.mark.parametrize("strategy,dtype,hybrid", CASES)
def test_offloaded_training_equals_the_unsharded_reference(results, strategy, dtype, hybrid):
    for rank, result in enumerate(results):
        diff, separate, collectives_on_host = result[f"{strategy}/{dtype}/{hybrid}"]
        assert diff < TOL[dtype], (rank, diff)
        assert separate, rank
        assert collectives_on_host == [], (rank, collectives_on_host)


def test_cpu_mesh_gets_no_offload():
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    from flatfsdp.engine.layout.main_home import DEVICE, HostHome

    assert HostHome.for_policy(CPUOffloadPolicy(), "cpu") is DEVICE
    assert HostHome.for_policy(OffloadPolicy(), "cuda") is DEVICE
    assert HostHome.for_policy(CPUOffloadPolicy(pin_memory=False), "cuda") == HostHome(pin_memory=False)


def test_host_main_weights_refuse_block_scaled_gathers_by_name():
    """Block-scaled gathers encode the main weights on the device: with them in
    host memory the group is refused, naming the keyword and the parameter."""
    from flatfsdp.engine.layout.block_formats import block_format
    from flatfsdp.engine.layout.main_home import DEVICE, HostHome

    DEVICE.check_weight_codes(block_format("int8"), "blocks.0.fc.weight")  # on the device: fine
    HostHome().check_weight_codes(None, "blocks.0.fc.weight")  # no codes: fine
    with pytest.raises(NotImplementedError, match=r"param_gather_dtype='int8' with offload_policy=CPUOffloadPolicy "
                                                  r"\(parameter 'blocks.0.fc.weight'\)"):
        HostHome().check_weight_codes(block_format("int8"), "blocks.0.fc.weight")


def _dtensor_over_host_memory(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from flatfsdp.engine.layout.local_dtensor import dtensor_over

    # An accelerator's mesh, as an offloaded group has (no backend: nothing travels here).
    mesh = DeviceMesh("cuda", torch.arange(world), _init_backend=False)
    host = torch.arange(8.0)
    kept = dtensor_over(host, mesh, [Shard(0)], shape=torch.Size([8 * world]), stride=(1,))
    try:
        DTensor.from_local(host, mesh, [Shard(0)], run_check=False)
        moved = "no"
    except (AssertionError, RuntimeError):  # it tried to copy to a device this machine lacks
        moved = "tried"
    local = kept.to_local()
    return dict(device=local.device.type, same_storage=local.untyped_storage().data_ptr()
                == host.untyped_storage().data_ptr(), shape=tuple(kept.shape), from_local=moved)


def test_sharded_dtensors_keep_host_memory_on_an_accelerator_mesh():
    """Offloaded main weights and grads are host tensors on an accelerator's mesh:
    the DTensors the optimizer steps must keep them there, not a device copy
    (``DTensor.from_local`` would copy them over: on the first lent GPU the
    optimizer then stepped a copy and the host weights never moved)."""
    result = run_ranks(_dtensor_over_host_memory, 1)[0]
    assert result == dict(device="cpu", same_storage=True, shape=(8,), from_local="tried"), result
