"""Pure arithmetic of a flat buffer: where each parameter sits, padding, and
which contiguous range each rank owns.

Knows numbers only (no torch.distributed, no modules), so it is tested alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """One parameter inside a flat buffer."""

    offset: int
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class FlatLayout:
    segments: tuple[Segment, ...]
    world_size: int
    padded_numel: int
    """Total elements, a multiple of ``world_size`` so every rank owns an equal range."""

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def local_piece(self, index: int, rank: int) -> tuple[int, int]:
        """(start, end) of parameter ``index`` that ``rank`` owns, relative to the
        parameter's own flattened elements; start == end when it owns none."""
        seg = self.segments[index]
        lo, hi = self.shard_range(rank)
        start, end = max(seg.offset, lo), min(seg.end, hi)
        if start >= end:
            # Empty piece, placed where the rank's range meets the parameter so
            # offsets stay monotonic.
            clamp = min(max(lo - seg.offset, 0), seg.numel)
            return clamp, clamp
        return start - seg.offset, end - seg.offset

    @property
    def numel(self) -> int:
        """Elements used by parameters, padding excluded."""
        return sum(s.numel for s in self.segments)


def build_layout(numels: list[int], world_size: int, align: int = 1) -> FlatLayout:
    """Concatenate parameters, starting each at a multiple of ``align`` elements,
    and pad the end to a multiple of ``align * world_size`` so each rank's shard
    starts aligned too."""
    if world_size < 1 or align < 1:
        raise ValueError(f"world_size ({world_size}) and align ({align}) must be positive")
    segments, cursor = [], 0
    for numel in numels:
        if numel < 0:
            raise ValueError(f"negative numel {numel}")
        cursor = _round_up(cursor, align)
        segments.append(Segment(cursor, numel))
        cursor += numel
    padded = _round_up(cursor, align * world_size) if cursor else 0
    return FlatLayout(tuple(segments), world_size, padded)


def _round_up(value: int, multiple: int) -> int:
    return math.ceil(value / multiple) * multiple
