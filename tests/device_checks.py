"""The engine's behaviour on one device: CUDA where one is lent (NCCL, side
streams, the caching allocator, pinned memory, float8 matmuls), else the same
checks on the CPU (gloo) where they mean something there.

Each check is a plain function ``run(device, workdir) -> figures`` that
raises AssertionError when the behaviour is broken and ``Unavailable`` when
it cannot run here. Nothing here imports pytest: tests/test_cuda.py runs the
checks under pytest (``pytest -m cuda``), and tools/gpu_check.sh through
tests/run_device_checks.py, one process each, where pytest may be missing.

One GPU is one rank: NCCL refuses two ranks on one device, so every check
runs at world 1 -- a real NCCL communicator, collectives of one rank. What
needs two or more ranks (sums across ranks, shard arithmetic, prefetch order,
races under injected delays) is checked by the gloo tests on CPU; docs/gpu.md
lists which file checks what.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

import device_checks_estimator as estimator
import device_checks_state as state
import device_checks_training as training_checks
import device_checks_wire as wire


@dataclass(frozen=True)
class Check:
    name: str
    checks: str
    """What it asserts, in a line (the report and docs/gpu.md)."""
    run: Callable[[torch.device, Path], dict]


CHECKS = {c.name: c for c in (
    Check("parity_one_call", "ZeRO-1/2/3 through fully_shard(model, optimizer, ...), bf16 compute with fp32 main "
          "weights, world 1 over NCCL: losses and main weights follow the unsharded model; ZeRO-3 as one rank "
          "holds it (nothing gathered) and with its chunk gathered as in a larger group",
          training_checks.check_parity_one_call),
    Check("parity_per_module", "the same through FSDP2's door (fully_shard per block, torch's MixedPrecisionPolicy, "
          "optimizer built after)", training_checks.check_parity_per_module),
    Check("side_streams", "every gather and reduction runs on a side stream; with side streams delayed and "
          "gathered buffers poisoned, training equals the synchronous run; without the event waits it does not",
          training_checks.check_side_streams),
    Check("allocator_steady", "no record_stream; allocated bytes constant and reserved bytes not growing from "
          "step 3 to step 20", training_checks.check_allocator_steady),
    Check("cpu_offload", "CPUOffloadPolicy: parity; sharded weights, grads and Adam state in pinned host memory; "
          "compute on the device; less device memory", state.check_cpu_offload),
    Check("meta_init", "a meta-device model is initialised straight onto the device, equal to reset_parameters "
          "there, the caller's RNG untouched; it trains", state.check_meta_init),
    Check("dcp_across_devices", "a DCP checkpoint (model + AdamW) saved on the device loads on the CPU and back, "
          "bitwise", state.check_dcp_across_devices),
    Check("float8_all_gather", "torchao float8 with float8 all-gather: one byte an element gathered, "
          "Float8TrainingTensor compute, training follows unsharded float8 (needs torchao and _scaled_mm)",
          state.check_float8_all_gather),
    Check("lowbit_wire", "int8/fp8 weight gathers, bf16/int8 gradient reductions (ZeRO-3): the module computes "
          "with exactly the quantize-dequantize of its main weights, trains as the unsharded model doing so (coded "
          "gradients within 2%), bytes as on the CPU", wire.check_lowbit_wire),
    Check("tied_rows_unit", "the tied table and head as one unit with row lookups and a paced table gather: "
          "trains as the unsharded model; the batch's rows travel, not the table", wire.check_tied_rows_unit),
    Check("schedule_trace", "the estimator's fake-world trace of a step on the device is the op sequence the "
          "device runs (what a probe of it prices); the engine's step traces there too",
          estimator.check_schedule_trace),
)}
