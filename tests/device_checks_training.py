"""Device checks of training itself: parity with the unsharded model through
both front doors, side streams used and ordered, the allocator steady.

Each ``check_*(device, workdir)`` asserts, returns its figures, or raises
``Unavailable`` (tests/device_checks.py lists them).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import flatfsdp
from device_world import (chunk_kept_as_in_a_larger_group, main_weights, regression_data, require_cuda,
                          residual_mlp, synchronize, world_of_one)
from flatfsdp.models.gpt import TransformerBlock
from training import batches, make_model, make_optimizer, max_diff, train_reference, train_sharded

ZERO = {"optim": 1, "optim_grads": 2, "optim_grads_params": 3}
PARITY_STEPS = 10
LR = 3e-3  # make_optimizer's AdamW


# ---- parity ------------------------------------------------------------------------------

def _one_call(model, mesh, strategy):
    """Megatron-FSDP's door: the optimizer built on the plain model, bound by the call."""
    opt = make_optimizer("adamw", model.named_parameters())
    policy = flatfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return flatfsdp.fully_shard(model, opt, device_mesh=mesh, fsdp_unit_modules=[TransformerBlock],
                                zero_dp_strategy=strategy, mixed_precision_policy=policy)


def _per_module(model, mesh, strategy):
    """FSDP2's door: each block, then the root, with torch's own policy; the optimizer after."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        flatfsdp.fully_shard(block, mesh=mesh, mp_policy=policy, zero_dp_strategy=strategy)
    flatfsdp.fully_shard(model, mesh=mesh, mp_policy=policy, zero_dp_strategy=strategy)
    return model, make_optimizer("adamw", model.named_parameters())


def _parity(device: torch.device, workdir: Path, shard) -> dict:
    data = batches(PARITY_STEPS)
    ref_losses, ref_params = train_reference(PARITY_STEPS, "adamw", bf16=True, data=data, device=device)
    reference = {name: p.float().cpu() for name, p in ref_params.items()}
    figures = {}
    with world_of_one(device, workdir) as mesh:
        figures["backend"] = str(dist.get_backend(mesh.get_group()))
        if device.type == "cuda":
            assert "nccl" in figures["backend"], figures
        # ZeRO-3 twice: as one rank holds it (the chunk is the whole group: nothing
        # gathered, the main weights cast per unit), and with the chunk kept and
        # gathered over the backend as in a larger group.
        cases = [(f"zero{stage}", strategy, False) for strategy, stage in ZERO.items()]
        cases.append(("zero3_kept_chunk", "optim_grads_params", True))
        for label, strategy, kept in cases:
            with chunk_kept_as_in_a_larger_group() if kept else contextlib.nullcontext():
                model, opt = shard(make_model().to(device), mesh, strategy)
            seen = set()
            model.blocks[0].attn.qkv.register_forward_pre_hook(
                lambda m, args: seen.add((m.weight.dtype, m.weight.device.type)))
            flatfsdp.comm_account().reset()
            losses = train_sharded(model, opt, 0, 1, [x.to(device) for x in data])
            account = flatfsdp.comm_account().snapshot()
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            diff = max_diff(main_weights(model), reference)
            gathers = account.get("all_gather", {}).get("count", 0)
            figures.update({f"{label}.loss_rel_diff": worst, f"{label}.main_weight_diff": diff,
                            f"{label}.gathers": gathers})
            assert seen == {(torch.bfloat16, device.type)}, (label, seen)  # bf16 compute, on the device
            assert {p.dtype for g in opt.param_groups for p in g["params"]} == {torch.float32}, label
            assert worst < 2e-2, (label, losses, ref_losses)
            # Adam moves a weight by at most about the learning rate a step: a
            # main weight further off than two steps' worth was not stepped alike.
            assert diff < 2 * LR * PARITY_STEPS, (label, diff)
            assert sum(losses[-3:]) < sum(losses[:3]), (label, losses)  # it learns
            if label == "zero3":
                assert gathers == 0, account  # the whole group on this rank: nothing travels
            if kept:
                assert gathers > 0, account  # weights did travel through the backend
            del model, opt
    return figures


def check_parity_one_call(device: torch.device, workdir: Path) -> dict:
    return _parity(device, workdir, _one_call)


def check_parity_per_module(device: torch.device, workdir: Path) -> dict:
    return _parity(device, workdir, _per_module)


# ---- side streams ----------------------------------------------------------------------------

SLEEP_CYCLES = 20_000_000
"""About 10 ms of a GPU's clock: far longer than the host takes to queue the
kernels that follow, so a read not ordered after the collective runs first."""
STREAM_STEPS = 4


class _CollectiveStreams(TorchDispatchMode):
    """The stream each all-gather / reduce-scatter is issued on."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, bool]] = []
        self.compute = torch.accelerator.current_stream()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if func.namespace == "c10d" and ("gather" in name or "reduce_scatter" in name):
            kind = "reduce_scatter" if "reduce_scatter" in name else "all_gather"
            self.seen.append((kind, torch.accelerator.current_stream() == self.compute))
        return func(*args, **(kwargs or {}))


def _patched(*, late: bool, synchronous: bool, poison: bool, waits: bool) -> contextlib.ExitStack:
    """Side-stream work delayed (``late``) or waited for by the host at once
    (``synchronous``); gathered weight buffers filled with NaN when allocated
    (``poison``: a read before the gather lands sees them); the compute
    stream's waits on side-stream events dropped (``waits=False``: the bug)."""
    from flatfsdp.engine.comm import collectives
    from flatfsdp.engine.layout.buffer import FlatBuffer
    from flatfsdp.engine.layout.device import SideStream

    launch, alloc = SideStream.launch, FlatBuffer.alloc

    def launch_late(self, issue):
        def issue_late():
            torch.cuda._sleep(SLEEP_CYCLES)  # on the side stream: the launch is inside its context
            return issue()
        return launch(self, issue_late)

    def launch_and_wait(self, issue):
        result = launch(self, issue)
        torch.accelerator.synchronize()
        return result

    def alloc_poisoned(self):
        fresh = not self.is_allocated
        alloc(self)
        if fresh and self.name == "model weights":
            self.data.fill_(float("nan"))

    stack = contextlib.ExitStack()
    if late or synchronous:
        stack.enter_context(mock.patch.object(SideStream, "launch", launch_late if late else launch_and_wait))
    if poison:
        stack.enter_context(mock.patch.object(FlatBuffer, "alloc", alloc_poisoned))
    if not waits:
        stack.enter_context(mock.patch.object(collectives, "wait_event", lambda event: None))
    return stack


def _stream_run(device: torch.device, mesh, **patches) -> dict:
    data = regression_data(512, 64, STREAM_STEPS)
    model = residual_mlp(512, 4).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    policy = flatfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with chunk_kept_as_in_a_larger_group():  # gathers on side streams, as in a larger group
        model, opt = flatfsdp.fully_shard(model, opt, device_mesh=mesh, fsdp_unit_modules=[type(model.blocks[0])],
                                          zero_dp_strategy="optim_grads_params", mixed_precision_policy=policy,
                                          bucket_bytes=0)
    streams = _CollectiveStreams()
    losses = []
    with _patched(**patches), streams:
        for x, y in data:
            # The loss in fp32: torch 2.11's mse_loss backward refuses a bf16 output
            # beside an fp32 target ("Found dtype Float but expected BFloat16").
            loss = F.mse_loss(model(x.to(device)).float(), y.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    synchronize(device)
    return dict(losses=losses, mains=main_weights(model), streams=streams.seen)


def _agree(a: dict, b: dict) -> bool:
    if a["mains"].keys() != b["mains"].keys():
        return False
    finite = all(torch.isfinite(torch.tensor(r["losses"])).all() for r in (a, b))
    return finite and torch.allclose(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=1e-5, atol=1e-6) \
        and max_diff(a["mains"], b["mains"]) <= 1e-6


def check_side_streams(device: torch.device, workdir: Path) -> dict:
    require_cuda(device, "no streams; collectives are waited through gloo's work handles, which the "
                         "multi-rank parity tests (tests/test_parity.py, tests/test_schedule.py) train through")
    with world_of_one(device, workdir) as mesh:
        reference = _stream_run(device, mesh, late=False, synchronous=True, poison=False, waits=True)
        late = _stream_run(device, mesh, late=True, synchronous=False, poison=True, waits=True)
        try:
            broken = _stream_run(device, mesh, late=True, synchronous=False, poison=True, waits=False)
        except Exception as error:  # noqa: BLE001 -- the race seen as an error counts as seen
            broken = dict(losses=[repr(error)[:200]], mains={}, streams=[])
    kinds = {kind for kind, _ in late["streams"]}
    on_compute = [kind for kind, compute in late["streams"] if compute]
    figures = {"collectives": len(late["streams"]), "on_compute_stream": len(on_compute),
               "late_vs_synchronous": max_diff(late["mains"], reference["mains"]),
               "late_losses": late["losses"], "without_waits_losses": broken["losses"]}
    assert kinds == {"all_gather", "reduce_scatter"}, figures
    assert not on_compute, figures  # every gather and reduction ran on a side stream
    assert _agree(late, reference), figures  # delayed side streams change nothing: every read waited
    # The check has teeth: without the waits, the same delay shows (NaN weights read, or stale gradients).
    assert not _agree(broken, reference), ("a read before its event went unseen", figures)
    return figures


# ---- the caching allocator -------------------------------------------------------------------

ALLOCATOR_STEPS = 20


class _RecordStreamCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.record_stream:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def check_allocator_steady(device: torch.device, workdir: Path) -> dict:
    require_cuda(device, "no caching allocator; host memory per step is covered by the bench's peak figures")
    with world_of_one(device, workdir) as mesh:
        model = make_model().to(device)
        model, opt = _one_call(model, mesh, "optim_grads_params")
        data = batches(ALLOCATOR_STEPS)
        allocated, reserved = [], []
        calls = _RecordStreamCalls()
        with calls:
            for x in data:
                train_sharded(model, opt, 0, 1, [x.to(device)])
                torch.cuda.synchronize()
                allocated.append(torch.cuda.memory_allocated())
                reserved.append(torch.cuda.memory_reserved())
    figures = {"record_stream_calls": calls.calls, "allocated_after_step_3": allocated[2],
               "allocated_after_step_20": allocated[-1], "reserved_after_step_3": reserved[2],
               "reserved_after_step_20": reserved[-1]}
    assert calls.calls == 0, figures  # lifetimes are the engine's, never the allocator's cross-stream bookkeeping
    # From the third step (AdamW's state exists, every buffer has been made once) nothing grows.
    assert len(set(allocated[2:])) == 1, (figures, allocated)
    assert max(reserved[2:]) == reserved[2], (figures, reserved)
    return figures
