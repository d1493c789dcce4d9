"""Device checks of where state lives: CPU offload in pinned memory, meta-device
init straight onto the device, DCP checkpoints across devices, torchao's
float8 all-gather.

Each ``check_*(device, workdir)`` asserts, returns its figures, or raises
``Unavailable`` (tests/device_checks.py lists them).
"""

from __future__ import annotations

import copy
import gc
from pathlib import Path

import torch
import torch.nn.functional as F

import flatfsdp
from device_world import (Block, Net, Unavailable, main_weights, regression_data, require_cuda, residual_mlp,
                          synchronize, world_of_one)
from flatfsdp.models.gpt import GPT, TransformerBlock
from training import CFG, batches, make_model, make_optimizer, max_diff, train_sharded

# ---- CPU offload -----------------------------------------------------------------------------

def _offload_run(device: torch.device, mesh, offload: bool) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy

    gc.collect()  # the other run's model (reference cycles through hooks) off the device first
    start = torch.accelerator.memory_allocated()
    model = residual_mlp(32, 3).to(device)
    ref = copy.deepcopy(model)
    policy = CPUOffloadPolicy() if offload else None
    for block in model.blocks:
        flatfsdp.fully_shard(block, mesh=mesh, offload_policy=policy)
    flatfsdp.fully_shard(model, mesh=mesh, offload_policy=policy)
    seen = []
    model.blocks[0].fc1.register_forward_pre_hook(lambda m, a: seen.append(m.weight.device.type))
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    for x, _ in regression_data(32, 8, 3):
        x = x.to(device)
        model(x).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        grads = [p.grad.to_local() for p in model.parameters()]
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    synchronize(device)
    locals_ = [p.to_local() for p in model.parameters()]
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    # At one rank a local shard is the whole parameter (read without a collective:
    # NCCL cannot take the host tensors offloaded shards are).
    mains = {n: p.to_local().detach().float().cpu() for n, p in model.named_parameters()}
    return dict(diff=max_diff(mains, {n: p.detach().cpu() for n, p in ref.named_parameters()}),
                params=sorted({(t.device.type, t.is_pinned()) for t in locals_}),
                grads=sorted({t.device.type for t in grads}), state=sorted({t.device.type for t in state}),
                compute=sorted(set(seen)), device_bytes=torch.accelerator.memory_allocated() - start)


def check_cpu_offload(device: torch.device, workdir: Path) -> dict:
    """Parity with the unsharded model; sharded parameters, their grads and
    Adam's state in pinned host memory; the module computing on the device;
    less device memory than without offload."""
    require_cuda(device, "a CPU mesh gets no offload (HostHome.for_policy); tests/test_offload.py builds the "
                         "offloaded layout on gloo and checks it there")
    with world_of_one(device, workdir) as mesh:
        # The unsharded reference's share of device memory is the same in both runs.
        # A first run pays the device's one-time allocations -- cuBLAS's
        # workspaces alone were 64 MiB on an H200 -- so one run, not measured,
        # goes before the two compared.
        _offload_run(device, mesh, False)
        on = _offload_run(device, mesh, True)
        off = _offload_run(device, mesh, False)
    figures = {"offloaded_diff": on["diff"], "resident_diff": off["diff"], "offloaded_device_bytes": on["device_bytes"],
               "resident_device_bytes": off["device_bytes"]}
    assert on["diff"] < 1e-5 and off["diff"] < 1e-5, figures
    assert on["params"] == [("cpu", True)] and on["grads"] == ["cpu"] and on["state"] == ["cpu"], on
    assert on["compute"] == [device.type] and off["params"] == [(device.type, False)], (on, off)
    assert on["device_bytes"] < off["device_bytes"], figures
    return figures


# ---- meta-device init ------------------------------------------------------------------------

SEED = 7


def _rng_states(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type != "cpu":
        states.append(torch.get_device_module(device.type).get_rng_state(device))
    return states


def check_meta_init(device: torch.device, workdir: Path) -> dict:
    """A model built on the meta device is materialised unit by unit straight
    onto the device, with the values ``flatfsdp.reset_parameters`` gives the
    same model built there, leaving the caller's random state alone."""
    with world_of_one(device, workdir) as mesh:
        with torch.device("meta"):
            model = GPT(CFG)
        opt = make_optimizer("adamw", model.named_parameters())
        before = _rng_states(device)
        model, opt = flatfsdp.fully_shard(model, opt, device_mesh=mesh, fsdp_unit_modules=[TransformerBlock],
                                          init_model_with_meta_device=True, meta_init_seed=SEED)
        places = {p.to_local().device.type for p in model.parameters()}
        for unit in [m for m in model.modules() if isinstance(m, flatfsdp.FSDPModule)]:
            unit.unshard()  # a unit's first use runs its deferred initialisation
            unit.reshard()
        values = main_weights(model)
        after = _rng_states(device)
        with torch.device(device):
            reference = flatfsdp.reset_parameters(GPT(CFG), SEED)
        losses = train_sharded(model, opt, 0, 1, [x.to(device) for x in batches(3)])
    figures = {"max_diff": max_diff(values, {n: p.detach().cpu() for n, p in reference.named_parameters()}),
               "losses": losses}
    assert places == {device.type}, places
    assert figures["max_diff"] == 0.0, figures
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "initialisation changed the caller's RNG state"
    assert all(map(torch.isfinite, map(torch.tensor, losses))) and losses[-1] < losses[0], figures
    return figures


# ---- DCP across devices ----------------------------------------------------------------------

def _sharded_gpt(device: torch.device, mesh):
    model = make_model().to(device)
    return flatfsdp.fully_shard(model, make_optimizer("adamw", model.named_parameters()), device_mesh=mesh,
                                fsdp_unit_modules=[TransformerBlock])


def _state(model, opt) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _full_state(model, opt) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer state, full and on the CPU, by key."""
    out = {f"model.{k}": v for k, v in main_weights(model).items()}
    for param_id, entry in sorted(opt.state_dict()["state"].items()):
        for key, value in entry.items():
            if torch.is_tensor(value):
                full = value.full_tensor() if hasattr(value, "full_tensor") else value
                out[f"optim.{param_id}.{key}"] = full.detach().float().cpu().clone()
    return out


def _save_train_load(source, target, data, checkpoint: Path, device_of_source: torch.device) -> float:
    """Train ``source`` a step, save it with DCP, load into ``target``; the largest difference."""
    import torch.distributed.checkpoint as dcp

    model, opt = source
    train_sharded(model, opt, 0, 1, [data.to(device_of_source)])
    dcp.save(_state(model, opt), checkpoint_id=str(checkpoint))
    state = _state(*target)
    dcp.load(state, checkpoint_id=str(checkpoint))
    target[0].load_state_dict(state["model"])
    target[1].load_state_dict(state["optim"])
    return max_diff(_full_state(*target), _full_state(model, opt))


def check_dcp_across_devices(device: torch.device, workdir: Path) -> dict:
    """A DCP checkpoint saved from the device loads into the same model
    sharded on the CPU, and back, every value equal (model and AdamW state)."""
    from torch.distributed.device_mesh import init_device_mesh

    cpu = torch.device("cpu")
    data = batches(2)
    with world_of_one(device, workdir) as mesh:
        host_mesh = mesh if device.type == "cpu" else init_device_mesh("cpu", (1,))
        on_device, on_host = _sharded_gpt(device, mesh), _sharded_gpt(cpu, host_mesh)
        there = _save_train_load(on_device, on_host, data[0], workdir / "from_device", device)
        fresh = _sharded_gpt(device, mesh)
        back = _save_train_load(on_host, fresh, data[1], workdir / "from_host", cpu)
        devices = {p.to_local().device.type for p in fresh[0].parameters()}
    figures = {"device_to_host_diff": there, "host_to_device_diff": back}
    assert there == 0.0 and back == 0.0, figures
    assert devices == {device.type}, devices
    return figures


# ---- torchao float8 all-gather ----------------------------------------------------------------

def _scaled_mm_runs(device: torch.device) -> None:
    a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
    b = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device=device)
    try:
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as error:
        raise Unavailable(f"torch._scaled_mm does not run on {device}: {str(error).splitlines()[0]}") from None


def _float8_net(all_gather: bool, device: torch.device) -> Net:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    net = Net([Block() for _ in range(3)]).to(device)
    return convert_to_float8_training(net, config=Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather))


def _per_module(net, mesh):
    for block in net.blocks:
        flatfsdp.fully_shard(block, mesh=mesh)
    flatfsdp.fully_shard(net, mesh=mesh)
    return net


def _train_float8(net, data) -> list[float]:
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    losses = []
    for x, y in data:
        loss = F.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def check_float8_all_gather(device: torch.device, workdir: Path) -> dict:
    """torchao float8 training with float8 all-gather: the subclass survives
    sharding, weights travel as one byte an element, the unit computes with
    float8 tensors, and training follows the unsharded float8 model."""
    try:
        import torchao.float8  # noqa: F401
    except Exception as error:  # noqa: BLE001 -- absent, or built for another torch: either way not ours to test
        raise Unavailable(f"torchao does not import ({type(error).__name__}: {error})") from None
    _scaled_mm_runs(device)
    data = [(x.to(device), y.to(device)) for x, y in regression_data(32, 64, 4)]
    with world_of_one(device, workdir) as mesh:
        reference = _train_float8(_float8_net(True, device), data)
        plain = _train_float8(_per_module(_float8_net(False, device), mesh), data)  # weights gathered in fp32
        net = _per_module(_float8_net(True, device), mesh)
        local_class = type(net.blocks[0].fc1.weight._local_tensor).__name__
        float8 = _train_float8(net, data)
        flatfsdp.comm_account().reset()
        net.blocks[1].unshard()
        gathered = flatfsdp.comm_account().snapshot()["all_gather"]["bytes"]
        computes_with = type(net.blocks[1].fc1.weight).__name__
        net.blocks[1].reshard()
    numel = sum(p.numel() for p in net.blocks[1].parameters())
    gap = max(abs(a - b) for a, b in zip(float8, reference))
    allowed = max(abs(a - b) for a, b in zip(plain, reference))
    figures = {"gap_to_reference": gap, "fp32_gather_gap": allowed, "gathered_bytes": gathered, "numel": numel,
               "losses": float8}
    assert local_class == "WeightWithDynamicFloat8CastTensor", local_class
    assert gathered == numel, figures  # float8 data: one byte an element
    assert computes_with == "Float8TrainingTensor", computes_with
    assert gap <= allowed * 1.05 + 1e-4, figures
    assert float8[-1] < float8[0], figures
    return figures
