"""Batches of packed windows, a pure function of (seed, step).

The token stream (documents joined by the end-of-document id) is cut into
windows of ``seq_length + 1`` tokens, window ``w`` starting at ``w * seq_length``
(the last token of one window is the first of the next: it is only ever a
target in one and an input in the other). Training visits the windows epoch
by epoch, each epoch in its own seeded order: sample ``k`` of the run (step
``s``'s global batch holds samples ``(s - 1) * G ... s * G - 1``) is window
``order(seed, k // W)[k % W]``. Nothing lives in a loader: a resumed run, or
one on a different number of ranks with the same global batch, sees exactly
the same batches.
"""

from __future__ import annotations

import hashlib

import torch


def _epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.sha256(f"flatfsdp-packed-order:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


class PackedWindows:
    """Windows of a 1-D token tensor (memory-mapped uint16/uint32 is fine: only
    the rows of a batch are ever read)."""

    def __init__(self, tokens: torch.Tensor, seq_length: int, seed: int):
        self.tokens, self.seq_length, self.seed = tokens, seq_length, seed
        self.windows = (tokens.numel() - 1) // seq_length
        if self.windows < 1:
            raise ValueError(f"{tokens.numel()} tokens hold no window of --seq-length {seq_length} + 1")
        self._orders: dict[int, torch.Tensor] = {}
        """Epoch -> window order: a memo of a pure function (two epochs kept)."""

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            self._orders[epoch] = torch.randperm(self.windows, generator=generator)
        return self._orders[epoch]

    def rows(self, windows: torch.Tensor) -> torch.Tensor:
        """int64 ``[len(windows), seq_length + 1]``."""
        offsets = torch.arange(self.seq_length + 1)
        return self.tokens[windows[:, None] * self.seq_length + offsets[None, :]].long()

    def micro_batch(self, *, step: int, micro: int, rank: int, world: int, micro_batch_size: int,
                    accumulation: int) -> torch.Tensor:
        """This rank's rows of micro-batch ``micro`` of step ``step`` (1-based);
        rows are micro-major over ranks, as in train/data.py."""
        global_batch = micro_batch_size * world * accumulation
        first = (step - 1) * global_batch + (micro * world + rank) * micro_batch_size
        samples = torch.arange(first, first + micro_batch_size)
        epochs = samples // self.windows
        picked = torch.stack([self._order(int(e))[int(k)] for e, k in zip(epochs, samples % self.windows)])
        return self.rows(picked)

    def eval_batches(self, *, count: int, rank: int, world: int, micro_batch_size: int) -> list[torch.Tensor]:
        """Fixed held-out windows spread over the stream, the same at every evaluation."""
        wanted = count * world * micro_batch_size
        windows = torch.linspace(0, self.windows - 1, wanted).round().long()
        rows = self.rows(windows).view(count, world, micro_batch_size, self.seq_length + 1)[:, rank]
        return list(rows.unbind(0))
