"""Bytes per collective kind, counted where every engine's collectives pass:
the ``c10d`` operators of torch.distributed.

torch's ``CommDebugMode`` counts collectives but not their sizes, so this is a
small dispatch mode of the same kind that also adds up bytes. The unit matches
flatfsdp's own account: the size of the full (unsharded) buffer a collective
covers on this rank -- an all-gather's output, a reduce-scatter's input, an
all-reduce's tensor -- so engines compare byte for byte.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# op name -> (kind, index of the argument holding the full buffer)
_C10D = {
    "_allgather_base_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0),
    # Point-to-point: bytes this rank sends / receives (flatfsdp's gloo
    # exchanges are built from these; see flatfsdp/engine/comm/exchange.py).
    "send": ("send", 0),
    "recv_": ("recv", 0),
}
# Functional collectives (torch.compile / DTensor paths): the full buffer is the
# all-gather's result, the reduce-scatter's and all-reduce's input.
_FUNCTIONAL = {
    "all_gather_into_tensor": ("all_gather", None),
    "all_gather_into_tensor_coalesced": ("all_gather", None),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "all_reduce": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0),
}


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


class CollectiveBytes(TorchDispatchMode):
    """``with CollectiveBytes() as c: step()`` then ``c.snapshot()`` ->
    ``{kind: {"count": n, "bytes": b}}`` (same shape as flatfsdp's account)."""

    def __init__(self) -> None:
        super().__init__()
        self._counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        namespace, name = func.namespace, func.__name__.split(".")[0]
        if namespace == "c10d" and name in _C10D:
            kind, index = _C10D[name]
            self._add(kind, _nbytes(args[index]))
        elif namespace in ("_c10d_functional", "c10d_functional") and name in _FUNCTIONAL:
            kind, index = _FUNCTIONAL[name]
            self._add(kind, _nbytes(out if index is None else args[index]))
        return out

    def _add(self, kind: str, nbytes: int) -> None:
        entry = self._counts[kind]
        entry[0] += 1
        entry[1] += nbytes

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {k: {"count": c, "bytes": b} for k, (c, b) in sorted(self._counts.items())}
