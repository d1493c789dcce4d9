"""DeepSpeed ZeRO-3, when deepspeed is installed (``pip install deepspeed``;
on a CPU-only host it picks its CPU accelerator and talks gloo).

Configured as a user would with the other contenders' recipe: stage 3, the same
torch AdamW (client optimizer), no gradient clipping, bf16 with fp32 master
weights under --bf16, gradients communicated in the reduce dtype. Everything
else keeps DeepSpeed's defaults -- notably parameters under 100k elements
(LayerNorms, biases) stay unpartitioned (stage3_param_persistence_threshold),
which moves fewer bytes than the ZeRO-3 line.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys

import torch
from torch import nn



def unavailable_reason() -> str | None:
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed not installed (pip install deepspeed)"
    return None


def preload() -> None:
    """Import before the memory baseline, so the import is not billed as training memory."""
    if not torch.accelerator.is_available():
        # Say so up front instead of letting DeepSpeed probe and log a warning per rank.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # noqa: F401
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def ds_config(batch: int, bf16: bool, reduce_dtype: torch.dtype) -> dict:
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": bf16},
        "communication_data_type": "bf16" if reduce_dtype == torch.bfloat16 else "fp32",
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class DeepSpeedTrainer:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: dict) -> None:
        import deepspeed
        # DeepSpeed prints op-build messages on stdout, where the tables go.
        with contextlib.redirect_stdout(sys.stderr):
            self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.engine(x, targets=y)
        self.engine.backward(loss)
        self.engine.step()  # includes zero_grad
        return loss.detach()
