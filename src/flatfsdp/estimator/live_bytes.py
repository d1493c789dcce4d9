"""A meter of the bytes every tensor storage alive holds, and their high-water
mark, that works the same on real and on fake tensors.

The estimator runs a step on fake tensors (no memory behind them), so no
allocator can be asked: instead every op's outputs are seen through a dispatch
mode, each new storage is counted until it dies (a weak reference), and the
total is sampled after every op -- when the outputs are allocated and the inputs
still alive, the moment a peak happens. The engine's flat buffers change size
with no op (their storage is resized in place to gather or to free), so they
are re-read at each sample instead.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


@dataclass
class Peak:
    """What a rank held at its high-water mark, in bytes."""
    total: int = 0
    """Everything alive at the peak."""
    engine_transient: int = 0
    """The engine's flat buffers beyond what they held when metering began
    (gathered weights, unsharded gradients, re-allocated main grads)."""
    other_new: int = 0
    """Storages born since metering began and still alive: activations, the
    autograd graph's gradients, the optimizer's temporaries."""


class LiveBytes(TorchDispatchMode):
    """Meter the step run inside ``with LiveBytes(...)``. ``known`` are the
    tensors alive before it (weights, optimizer state, inputs); ``resizable``
    the engine's flat buffers (``flatfsdp.resizable_buffers``)."""

    def __init__(self, known: Iterable[torch.Tensor], resizable: Iterable[torch.Tensor]):
        super().__init__()
        self._resizable = distinct_storages(resizable)
        self._skip = {id(s) for s in self._resizable}
        self._sizes: dict[int, int] = {}
        self.fixed = 0
        """Bytes of the tracked (non-resizable) storages alive."""
        for storage in distinct_storages(known):
            self._track(storage)
        self.start_fixed = self.fixed
        self.start_resizable = self._resizable_bytes()
        self.start = self.start_fixed + self.start_resizable
        """Bytes alive when metering began."""
        self.peak = Peak(total=self.start)
        """The breakdown at the high-water mark."""
        self.engine_transient_peak = 0
        self.other_new_peak = 0

    @property
    def peak_total(self) -> int:
        return self.peak.total

    def _resizable_bytes(self) -> int:
        return sum(s.nbytes() for s in self._resizable)

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._skip:
            return
        size = storage.nbytes()
        if key in self._sizes:
            self.fixed += size - self._sizes[key]  # resized by an op (an out= result)
            self._sizes[key] = size
            return
        self._sizes[key] = size
        self.fixed += size
        weakref.finalize(storage, self._forget, key)

    def _adopt(self, storage: torch.UntypedStorage) -> None:
        """A storage first seen as an op's input existed before metering began
        (``known`` missed it): part of the start, not a new allocation."""
        before = self.fixed
        self._track(storage)
        grown = self.fixed - before
        self.start_fixed += grown
        self.start += grown

    def _forget(self, key: int) -> None:
        self.fixed -= self._sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for storage in distinct_storages(tree_leaves((args, kwargs))):
            if id(storage) not in self._sizes and id(storage) not in self._skip:
                self._adopt(storage)
        out = func(*args, **(kwargs or {}))
        for storage in distinct_storages(tree_leaves(out)):
            self._track(storage)
        self._sample()
        return out

    def _sample(self) -> None:
        resizable = self._resizable_bytes()
        transient = resizable - self.start_resizable
        other = self.fixed - self.start_fixed
        self.engine_transient_peak = max(self.engine_transient_peak, transient)
        self.other_new_peak = max(self.other_new_peak, other)
        total = self.fixed + resizable
        if total > self.peak.total:
            self.peak = Peak(total=total, engine_transient=transient, other_new=other)


class DispatchMeter:
    """`rank_step.Meter` on `LiveBytes`: only the metered step is watched."""

    start = peak_total = engine_transient_peak = other_new_peak = 0

    def __enter__(self) -> "DispatchMeter":
        return self

    def __exit__(self, *exc) -> None:
        pass

    @contextlib.contextmanager
    def step(self, known: list, resizable: list) -> Iterator[None]:
        with LiveBytes(known, resizable) as live:
            yield
        self.start, self.peak_total = live.start, live.peak_total
        self.engine_transient_peak, self.other_new_peak = live.engine_transient_peak, live.other_new_peak


def distinct_storages(tensors: Iterable) -> list[torch.UntypedStorage]:
    """The storages behind ``tensors`` (a wrapper subclass such as DTensor:
    its inner tensors'), each once."""
    found: dict[int, torch.UntypedStorage] = {}
    stack = [t for t in tensors if isinstance(t, torch.Tensor)]
    while stack:
        tensor = stack.pop()
        if is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            stack += [inner for inner in (getattr(tensor, name) for name in names) if isinstance(inner, torch.Tensor)]
            continue
        storage = tensor.untyped_storage()
        found.setdefault(id(storage), storage)
    return list(found.values())
