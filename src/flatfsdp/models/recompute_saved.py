"""Let autograd keep an activation's recipe instead of the activation.

``with remade_when_needed(out, remake): y = layer(out)`` -- wherever ``layer``
saves ``out`` (or a view of it) for backward, autograd keeps ``remake`` and
calls it when backward unpacks. For a cheap elementwise ``out = f(a)`` whose
input ``a`` is saved anyway (by ``f``'s own backward), that drops ``out``'s
bytes from what a forward leaves behind at the price of one more ``f``. The
recomputation runs the same kernel on the same input, so the values are
bitwise those of forward.

Only plain tensors take part; anything else autograd saves inside the block
(weights, tensor subclasses) is kept as usual, and nothing happens while
compiling (`applies`). Hooks nest innermost-first, so inside an outer
``saved_tensors_hooks`` the tensors saved within the block are this one's:
callers under activation checkpointing leave it off (the checkpoint decides
what is kept); under offloading they stay recipes instead of moving.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd.graph import saved_tensors_hooks


class _Recipe:
    __slots__ = ("size", "stride", "offset")

    def __init__(self, size, stride, offset):
        self.size, self.stride, self.offset = size, stride, offset


def _plain(t: torch.Tensor) -> bool:
    # Fake tensors count as plain: the memory estimator runs the model on them
    # (flatfsdp.estimator) and must see the same savings as a real run.
    return type(t) is torch.Tensor or isinstance(t, FakeTensor)


def _storage_id(t: torch.Tensor) -> int:
    """The storage's identity, for real and fake tensors alike (a fake
    tensor's data pointer is not an address)."""
    return t.untyped_storage()._cdata


def applies(out: torch.Tensor) -> bool:
    """Whether ``remade_when_needed`` should be used for ``out`` here."""
    return _plain(out) and out.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling()


@contextlib.contextmanager
def remade_when_needed(out: torch.Tensor, remake: Callable[[], torch.Tensor]):
    storage, base_offset = _storage_id(out), out.storage_offset()

    def pack(t: torch.Tensor):
        if _plain(t) and _storage_id(t) == storage:
            return _Recipe(t.size(), t.stride(), t.storage_offset() - base_offset)
        return t

    def unpack(packed):
        if isinstance(packed, _Recipe):
            return remake().as_strided(packed.size, packed.stride, packed.offset)
        return packed

    with saved_tensors_hooks(pack, unpack):
        yield
