"""Device check of what the estimator records: the schedule it prices is the
step the device runs. The bench's prediction traces a step on fake tensors of
the run's device; a trace of the CPU's ops instead (RMSNorm in five passes,
the CPU's attention, other casts) priced by a probe of an H200 put its step
18% long (docs/gpu.md, the third loan).

``check_*(device, workdir)`` asserts and returns its figures (tests/device_checks.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from flatfsdp.bench.options import parse
from flatfsdp.bench.prediction import probe_step, trace_run
from flatfsdp.estimator.schedule_trace import tracing

TINY_LLAMA = ("--preset gpu --num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 256 "
              "--seq-length 64 --micro-batch-size 1").split()


def _on_more_than_scalars(op) -> bool:
    return any(isinstance(arg, tuple) and len(arg) == 2 and arg[0] != () for arg in op.key[1:])


def check_schedule_trace(device: torch.device, workdir: Path) -> dict:
    cfg, _ = parse(TINY_LLAMA)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index or 0)
    step = probe_step(cfg.as_dict())  # on the accelerator where there is one (bench.workload.device)
    step()
    with tracing() as real:
        step()
    fake = trace_run(cfg, "floor", device.type)
    # Ops on 0-d tensors alone left out: AdamW's step counters, host scalars, where CUDA's
    # AdamW lifts its increment into a tensor (lift_fresh) and fake tensors do not.
    real_keys, fake_keys = ([op.key for op in trace.ops if _on_more_than_scalars(op)] for trace in (real, fake))
    differ = next((i for i, (a, b) in enumerate(zip(real_keys, fake_keys)) if a != b), None)
    assert real_keys == fake_keys, (
        f"the fake {device.type} trace is not the step the device runs: {len(fake_keys)} ops against "
        f"{len(real_keys)}, first difference at op {differ}: "
        f"{fake_keys[differ] if differ is not None else '-'} against {real_keys[differ] if differ is not None else '-'}")
    sharded = trace_run(cfg, "flatfsdp", device.type)
    assert len(sharded.ops) > len(fake.ops), "the engine's step traced no more ops than the plain model's"
    names = sorted({op.name for op in real.ops if "attention" in op.name or "norm" in op.name})
    return dict(ops=len(real_keys), sharded_ops=len(sharded.ops), kernels=names)
