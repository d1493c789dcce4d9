"""Named accelerators: the published peak throughput a compute model divides
work by, with where each figure comes from. The efficiencies applied to
them are assumptions, stated where they are used (compute_cost.Throughput)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    name: str
    matmul_tflops: dict[str, float]
    """Dense peak by the operands' dtype ("bfloat16", "float16", "float32")."""
    memory_gbytes_s: float
    """Peak memory bandwidth, GB/s (10^9 bytes)."""
    source: str


DEVICES = {d.name: d for d in (
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5: 989 (bf16/fp16 dense), 67 (fp32) TFLOP/s, 3.35 TB/s HBM3.
    Device("h100", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}, 3350.0,
           "NVIDIA H100 datasheet (SXM5): 989 TFLOP/s dense bf16, 67 fp32, 3.35 TB/s"),
    # NVIDIA H200 datasheet, SXM: the same tensor cores as H100 SXM, 4.8 TB/s HBM3e.
    Device("h200", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}, 4800.0,
           "NVIDIA H200 datasheet (SXM): 989 TFLOP/s dense bf16, 67 fp32, 4.8 TB/s"),
    # NVIDIA A100 datasheet, SXM 80GB: 312 (bf16 dense), 19.5 (fp32) TFLOP/s, 2.04 TB/s HBM2e.
    Device("a100", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}, 2039.0,
           "NVIDIA A100 datasheet (SXM 80GB): 312 TFLOP/s dense bf16, 19.5 fp32, 2.04 TB/s"),
)}
