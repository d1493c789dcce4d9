"""What a compute op costs: from a named device's published throughput
(``Throughput``), or from what a probe of this machine measured (``Measured``,
probe.py). Either answers ``seconds(op)`` for the time model (timeline.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from flatfsdp.estimator.devices import Device
from flatfsdp.estimator.schedule_trace import Op


def op_dtype(op: Op) -> str:
    """The dtype an op computes in: its largest tensor argument's ("float32"
    when it has none). Not the first argument's: attention's backward takes
    its fp32 log-sum-exp beside bf16 queries, keys and values, and priced at
    fp32 it took 0.66 s of a predicted 1.0 s H200 step measured at 0.37 s."""
    tensors = [arg for arg in op.key[1:] if isinstance(arg, tuple) and len(arg) == 2 and isinstance(arg[1], str)]
    if not tensors:
        return "float32"
    return max(tensors, key=lambda arg: math.prod(arg[0]))[1]


@dataclass(frozen=True)
class Throughput:
    """A roofline of ``device``: matmul FLOPs at ``matmul_efficiency`` of the
    dtype's dense peak, bytes at ``memory_efficiency`` of the memory
    bandwidth, whichever takes longer, and at least ``min_op_s`` per op (a
    kernel's launch and tail). The efficiencies are assumptions, printed with
    every prediction."""
    device: Device
    matmul_efficiency: float = 0.7
    attention_efficiency: float = 0.5
    memory_efficiency: float = 0.8
    min_op_s: float = 4e-6

    def seconds(self, op: Op) -> float:
        if op.nbytes == 0 and op.flops == 0:
            return 0.0
        peak = self.device.matmul_tflops.get(op_dtype(op), min(self.device.matmul_tflops.values())) * 1e12
        efficiency = self.attention_efficiency if "attention" in op.name else self.matmul_efficiency
        flops_s = op.flops / (peak * efficiency)
        bytes_s = op.nbytes / (self.device.memory_gbytes_s * 1e9 * self.memory_efficiency)
        return max(flops_s, bytes_s, self.min_op_s)

    step_overhead_s = 0.0  # the host runs ahead of the device

    def describe(self) -> str:
        return (f"compute: {self.device.source}; assumed {self.matmul_efficiency:.0%} of peak on matmuls, "
                f"{self.attention_efficiency:.0%} on attention, {self.memory_efficiency:.0%} of memory bandwidth, "
                f">= {self.min_op_s * 1e6:.0f} us an op")


@dataclass
class OpRates:
    """Measured time of ops by signature, and per op name the seconds per unit
    of work (FLOPs where the op has any, else bytes) plus a fixed cost an op."""
    by_key: dict[tuple, float] = field(default_factory=dict)
    per_unit: dict[str, float] = field(default_factory=dict)
    """name -> seconds per FLOP (matmuls) or per byte."""
    per_op_s: float = 0.0
    """What dispatching an op costs beyond its kernel (a trivial op's time)."""
    step_overhead_s: float = 0.0
    """The rest of the probe's step beyond its ops: the model's Python, autograd's
    bookkeeping -- paid once a step by the same model however it is sharded."""
    flop_s: float = 0.0
    """Seconds per FLOP of every measured matmul together (an unmeasured matmul op)."""
    byte_s: float = 0.0
    """Seconds per byte of every measured op without FLOPs (an unmeasured op)."""
    overlapped: bool = False
    """Ops timed on an accelerator by its events: the host dispatches the next op
    while the device runs this one, so an op costs the longer of the two, not
    the sum (on the CPU the thread that dispatches also computes)."""

    def cost(self, kernel_s: float) -> float:
        """An op's seconds in a step, from its own time and its dispatch."""
        return max(kernel_s, self.per_op_s) if self.overlapped else kernel_s + self.per_op_s


@dataclass(frozen=True)
class Measured:
    """Ops timed on this machine by a probe of the same model: an op of the same
    signature costs what it cost there; another op of a measured name costs
    its work at that name's rate; any other op its work at the rate of its
    class (matmuls, or bytes moved). ``slowdown``: ranks sharing the cores
    beyond what the probe ran with (4 ranks on 2 cores: 2)."""
    rates: OpRates
    slowdown: float = 1.0
    source: str = "probe"
    engine_s: float = 0.0
    """The engine's host work a step beyond its ops (hooks, buffer allocations),
    as the probe measured it at one rank."""

    @property
    def step_overhead_s(self) -> float:
        return (self.rates.step_overhead_s + self.engine_s) * self.slowdown

    def seconds(self, op: Op) -> float:
        r = self.rates
        took = r.by_key.get(op.key)
        if took is None:
            if op.flops == 0 and op.nbytes == 0:
                took = 0.0
            else:
                work = op.flops or op.nbytes
                unit = r.per_unit.get(op.name, r.flop_s if op.flops else r.byte_s)
                took = work * unit
        return r.cost(took) * self.slowdown

    def describe(self) -> str:
        slow = f", x{self.slowdown:.2f} for ranks sharing its cores" if self.slowdown != 1 else ""
        return (f"compute: ops timed by the {self.source} ({len(self.rates.by_key)} signatures; otherwise "
                f"{1 / self.rates.flop_s / 1e9 if self.rates.flop_s else 0:.1f} GFLOP/s on matmuls, "
                f"{1 / self.rates.byte_s / 1e9 if self.rates.byte_s else 0:.2f} GB/s elsewhere; "
                f"{self.rates.per_op_s * 1e6:.1f} us an op, {self.rates.step_overhead_s * 1e3:.0f} ms a step "
                f"beyond the ops; the engine's host work {self.engine_s * 1e3:.0f} ms a step){slow}")
