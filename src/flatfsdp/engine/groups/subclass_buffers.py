"""The buffers of a group of protocol parameters (see subclass_gather): only
the gradient path is flat.

The main weights are the parameters' own sharded local tensors -- instances
of their subclass (a float8 cast wrapper around fp32 rows, NF4 codes and
scales), which only the subclass knows how to build, so they cannot be views
of a flat buffer. What the module computes with is what the subclass's
post-all-gather rebuilds from the gathered outputs. Gradients are plain
tensors: they take the flat path every group takes (rank-major accumulation,
reduce-scatter, main grads viewed by the ``.grad`` DTensors).
"""

from __future__ import annotations

from typing import Callable

import torch

from flatfsdp.engine.groups.buffers import GradientBuffers, _distinct_storage_bytes
from flatfsdp.engine.groups.subclass_gather import SubclassGatherPlan, inner_tensors
from flatfsdp.engine.groups.wire_choice import WireChoice
from flatfsdp.engine.layout.arithmetic import GroupLayout
from flatfsdp.engine.layout.main_home import DEVICE
from flatfsdp.engine.layout.placement import GroupPlacement


class SubclassBuffers(GradientBuffers):
    """The gradient buffers every group has; ``main_chunk`` is the parameter's
    sharded local tensor, the gathered weights are the codec's outputs."""

    def __init__(self, layout: GroupLayout, placement: GroupPlacement, *, index: int, device: torch.device,
                 main_dtype: torch.dtype, reduce_dtype: torch.dtype, trainable: bool,
                 locals_: Callable[[], list[torch.Tensor]], plan: SubclassGatherPlan | None, wire: WireChoice):
        """``wire``: their gradients reduce in ``reduce_dtype``, never as codes."""
        super().__init__(layout, placement, index=index, device=device, main_dtype=main_dtype,
                         reduce_dtype=reduce_dtype, trainable=trainable, home=DEVICE, wire=wire)
        self.main_in_unsharded = False
        self._locals = locals_
        self.plan = plan
        """The subclass's own gather (held for accounting)."""
        self.gather_codec = plan
        """What travels: the plan, or a user's FSDP2 AllGather around it."""

    def main_chunk(self, index: int) -> torch.Tensor:
        """The parameter's sharded local tensor (an instance of its subclass)."""
        return self._locals()[index]

    def main_tensors(self) -> list[torch.Tensor]:
        """The plain tensors inside the parameters' local tensors (what a broadcast sends)."""
        return self._weight_tensors()

    # ---- accounting ---------------------------------------------------------------------

    @property
    def gathered_bytes(self) -> int:
        return self.plan.gathered_bytes() if self.plan is not None else 0

    def _weight_tensors(self) -> list[torch.Tensor]:
        return [t for local in self._locals() for t in inner_tensors(local)]

    def _gathered_tensors(self) -> list[torch.Tensor]:
        return self.plan.gathered_tensors() if self.plan is not None else []

    def persistent_bytes_by_role(self) -> dict[str, int]:
        grads, released = self._persistent_grads()
        seen: dict[int, torch.UntypedStorage] = {}
        main_bytes = _distinct_storage_bytes(self._weight_tensors(), seen)
        kept = self._gathered_tensors() if self.placement.keep_model_weights else []
        model_bytes = _distinct_storage_bytes(kept, seen)
        return {"main weights": main_bytes, "model weights": model_bytes,
                "gradients": _distinct_storage_bytes(grads, seen) + released}

    def held_tensors(self) -> list[torch.Tensor]:
        held = self._weight_tensors() + ([self.main_grad] if self.main_grad is not None else [])
        return held + self.flat_buffers()

    def flat_buffers(self) -> list[torch.Tensor]:
        return self._grad_buffers() + self._gathered_tensors()

    def allocated_bytes(self) -> int:
        return _distinct_storage_bytes(self._weight_tensors() + self._gathered_tensors() + self._grad_tensors())
