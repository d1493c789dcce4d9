"""``GlobalMemoryBuffer``, a public helper of ``megatron_fsdp.utils``: named
scratch storage handed out again and again, so a caller that asks for the
same name each step allocates once. flatfsdp's own buffers never use it; it
is here so code written against megatron_fsdp.utils finds it. No instance is
created at import (there is no process-wide one, unlike stock's
``get_global_memory_buffer``): the caller owns the one it makes.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Sequence

import torch


def _current_device() -> torch.device:
    """The current accelerator's device (CUDA, XPU, ...), else the CPU: never ``torch.cuda`` by name."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return torch.device(accelerator.current_accelerator().type, accelerator.current_device_index())
    return torch.device("cpu")


class GlobalMemoryBuffer:
    """Storage per ``(name, dtype)``, grown when a larger shape is asked for.
    Two users of one name at once would share memory: callers keep names apart."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else _current_device()
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(self, tensor_shape: Sequence[int], dtype: torch.dtype, name: str,
                   mem_alloc_context: Callable | None = None) -> torch.Tensor:
        """A tensor of ``tensor_shape`` viewing the start of ``name``'s storage
        (its values are whatever was there: scratch, not zeros)."""
        numel = math.prod(tensor_shape)
        held = self.buffer.get((name, dtype))
        if held is None or held.numel() < numel:
            with (mem_alloc_context or contextlib.nullcontext)():
                held = torch.empty(numel, dtype=dtype, device=self.device)
            self.buffer[(name, dtype)] = held
        return held[:numel].view(*tensor_shape)
