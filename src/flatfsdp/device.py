"""The one place that knows which device kind this process runs on.

Nothing else in the engine names CUDA: CPU + gloo and accelerators share every
code path, and device specifics stay here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def default_device_type() -> str:
    """'cpu' under gloo, else the current accelerator's type (cuda, xpu, ...)."""
    if dist.is_initialized() and dist.get_backend() == "gloo":
        return "cpu"
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator().type
    return "cpu"
