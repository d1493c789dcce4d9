"""A flat tensor whose storage can be freed and re-allocated while the views
into it (the parameters, the gradient slots) stay the same Python objects.

Freeing by resizing the storage to zero, rather than dropping the tensor, is
what lets parameters be permanent views of the gathered buffer: an all-gather
lands straight in the memory autograd reads, with no copy-out.
"""

from __future__ import annotations

import torch


class FlatBuffer:
    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, *, allocated: bool = True,
                 name: str = "buffer"):
        self.name = name
        self.data = torch.empty(numel, dtype=dtype, device=device)
        self._nbytes = self.data.untyped_storage().nbytes()
        if not allocated:
            self.free()

    @property
    def numel(self) -> int:
        return self.data.numel()

    @property
    def is_allocated(self) -> bool:
        return self.data.untyped_storage().nbytes() > 0 or self._nbytes == 0

    @property
    def allocated_bytes(self) -> int:
        return self.data.untyped_storage().nbytes()

    def alloc(self) -> None:
        storage = self.data.untyped_storage()
        if storage.nbytes() != self._nbytes:
            storage.resize_(self._nbytes)

    def free(self) -> None:
        storage = self.data.untyped_storage()
        if storage.nbytes() != 0:
            storage.resize_(0)

    def view(self, start: int, end: int, shape: torch.Size | tuple[int, ...] | None = None) -> torch.Tensor:
        piece = self.data[start:end]
        return piece if shape is None else piece.view(shape)
