"""One rank's training step as the engine runs it, in order: every compute op
(with the work it does) and every collective the engine issues, posts and
waits for -- recorded in the same fake-world run the memory figures come
from. The time model (timeline.py) replays this record; nothing here, or
there, knows the engine's schedule by heart.

Compute ops are seen through a dispatch mode; the engine's collectives
through its communication account's listener (engine/comm/schedule_log.py).
Both append to one list, so their order is the order they happened in.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

import flatfsdp

_ENTER = torch.ops.profiler._record_function_enter_new.default
_EXIT = torch.ops.profiler._record_function_exit._RecordFunction
_FREE = frozenset({"empty", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_", "detach",
                   "lift_fresh", "_local_scalar_dense", "record_stream", "is_same_size", "sym_size", "sym_stride",
                   "sym_numel", "sym_storage_offset", "_has_compatible_shallow_copy_type", "_unsafe_view"})
"""Ops that move no bytes: allocations, storage swaps, metadata, and
``_unsafe_view`` (a view autograd does not track as one: 27 GB of "copies"
a step of the 1.2B bench Llama otherwise)."""
_NOT_COMPUTE = frozenset({"c10d", "c10d_functional", "_c10d_functional", "prim", "profiler"})
"""Namespaces of ops that are not compute: collectives (the link model times
them), metadata queries."""


@dataclass(frozen=True)
class Op:
    """One compute op on this rank."""
    name: str
    """aten's name without overload: "mm", "_foreach_mul_", ..."""
    flops: int
    nbytes: int
    """Bytes of the distinct tensors it reads and writes (0 for a view)."""
    key: tuple
    """Its exact signature (name, argument shapes and dtypes): a measured
    profile of the same model knows its time."""
    phase: str
    """"forward", "backward", "optimizer" or "engine" (a flatfsdp:: phase outside
    the model's own computation)."""


@dataclass
class StepTrace:
    """The records of one step, in order: ``Op`` and engine/comm/schedule_log's."""
    records: list = field(default_factory=list)
    issued_in: dict[int, str] = field(default_factory=dict)
    """Ticket -> the engine phase that issued it ("flatfsdp::prefetch (blocks.3)"):
    which unit a collective belongs to, for saying what is exposed."""

    @property
    def ops(self) -> list[Op]:
        return [r for r in self.records if isinstance(r, Op)]

    def flops(self, phases: tuple[str, ...] = ("forward", "backward")) -> int:
        """FLOPs the ops of these phases compute (recomputed forwards run inside backward)."""
        return sum(op.flops for op in self.ops if op.phase in phases)

    def model_flops(self) -> int:
        """A model FLOP/s figure's numerator: the forward's FLOPs three times
        (backward computes twice the forward's), recompute not counted -- the
        convention of model FLOPs utilisation (PaLM, Chowdhery et al. 2022) and
        of bench/flops.py."""
        return 3 * self.flops(("forward",))


class _Tracer(TorchDispatchMode):
    def __init__(self, trace: StepTrace):
        super().__init__()
        self.trace = trace
        self._labels: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _ENTER:
            self._labels.append(args[0])
        elif func is _EXIT and self._labels:
            self._labels.pop()
        out = func(*args, **kwargs)
        if is_compute(func):
            self.trace.records.append(describe_op(func, args, kwargs, out, self._phase()))
        return out

    def collective(self, record) -> None:
        """The engine's account tells of a collective (the listener)."""
        self.trace.records.append(record)
        if type(record).__name__ == "Issued":
            where = [label for label in self._labels if label.startswith("flatfsdp::")]
            self.trace.issued_in[record.ticket] = where[-1] if where else "(outside the engine's phases)"

    def _phase(self) -> str:
        label = next((l for l in reversed(self._labels) if l.startswith(("flatfsdp::", "Optimizer."))), "")
        if label.startswith("Optimizer."):
            return "optimizer"
        if label.startswith("flatfsdp::"):
            return "engine"
        return "backward" if torch._C._current_autograd_node() is not None else "forward"


@contextlib.contextmanager
def tracing() -> Iterator[StepTrace]:
    """Record the ops and the engine's collectives of what runs inside."""
    trace = StepTrace()
    tracer = _Tracer(trace)
    with flatfsdp.comm_account().listening(tracer.collective), tracer:
        yield trace


def _tensors(tree) -> list[torch.Tensor]:
    """The plain tensors in ``tree`` (a wrapper subclass such as DTensor: its local ones)."""
    out, stack = [], [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
    while stack:
        t = stack.pop()
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            stack += [getattr(t, n) for n in names if isinstance(getattr(t, n), torch.Tensor)]
        else:
            out.append(t)
    return out


def is_compute(func) -> bool:
    """An op that computes (not a profiler label, a collective or a metadata query)."""
    return func not in (_ENTER, _EXIT) and func.namespace not in _NOT_COMPUTE


def describe_op(func, args, kwargs, out, phase: str) -> Op:
    """``func(*args, **kwargs) -> out`` as an ``Op``: its work and signature."""
    name = func._overloadpacket.__name__
    inputs = _tensors((args, kwargs))
    key = (name,) + tuple((tuple(t.shape), str(t.dtype)[6:]) for t in inputs)
    if func.is_view or name in _FREE:
        return Op(name, 0, 0, key, phase)
    seen: dict[int, torch.Tensor] = {}
    for t in inputs + _tensors(out):
        seen.setdefault(id(t), t)
    nbytes = sum(t.numel() * t.element_size() for t in seen.values())
    return Op(name, _flops(func, args, kwargs, out), nbytes, key, phase)


def _flops(func, args, kwargs, out) -> int:
    """Matmul FLOPs (torch's flop counter's formulas; on the local tensors of a
    subclass), CPU attention included; 0 for everything else."""
    packet = func._overloadpacket
    local = lambda tree: [_local(x) for x in tree]  # noqa: E731
    try:
        if packet in flop_counter.flop_registry:
            return int(flop_counter.flop_registry[packet](*local(args), **kwargs, out_val=_local(out)))
        if packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
            q, k, v = (tuple(_local(t).shape) for t in args[:3])
            return int(flop_counter.sdpa_flop_count(q, k, v))
        if packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
            g, q, k, v = (tuple(_local(t).shape) for t in args[:4])
            return int(flop_counter.sdpa_backward_flop_count(g, q, k, v))
    except (TypeError, ValueError, IndexError):  # an overload whose arguments the formula does not read
        return 0
    return 0


def _local(x):
    if isinstance(x, torch.Tensor) and is_traceable_wrapper_subclass(x) and hasattr(x, "_local_tensor"):
        return x._local_tensor
    if isinstance(x, (list, tuple)):
        return type(x)(_local(v) for v in x)
    return x
