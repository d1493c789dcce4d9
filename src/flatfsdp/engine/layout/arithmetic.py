"""Pure arithmetic of a param group's flat buffers: which chunk of each
parameter every rank holds, and where it sits in each buffer.

Chunks follow DTensor's ``Shard(dim)`` rule (``torch.chunk``: ``ceil(n / W)``
along the sharded dimension, the last ranks holding less or nothing), so the
local tensor of every sharded parameter is exactly what its placement says.

Three views of the same numbers (W ranks, S = ``shard_numel``):

* the **local buffer** (S elements, one per rank): parameter ``i``'s chunk at
  ``[local_offset, local_offset + slot)``. ``slot`` is the *full* chunk size,
  so every rank's buffer has the same size and shorter chunks end in padding;
* the **wire layout** (W x S, rank-major): what an all-gather of the local
  buffers produces and what a reduce-scatter consumes;
* the **unsharded buffer** (W * S elements): parameter ``i`` occupies
  ``[W * local_offset, W * (local_offset + slot))``. For a dim-0 shard that
  region *is* the parameter's rows in order (rank r's chunk at
  ``W * local_offset + r * slot``), so gathered parameters are plain views of
  it and a chunk can be received straight into place.

Knows numbers only (no torch.distributed, no modules), so it is tested alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALIGN = 8
"""Every chunk slot starts at a multiple of 8 elements (16-32 bytes): aligned
views for vectorised kernels, at a padding cost of under 8 elements a parameter."""


@dataclass(frozen=True)
class ParamLayout:
    shape: tuple[int, ...]
    shard_dim: int | None
    """The dimension chunked across ranks; None: replicated (every rank holds all)."""
    world: int
    """Ranks the parameter is chunked over (1 when replicated)."""
    local_offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def dim_size(self) -> int:
        return 1 if self.shard_dim is None else self.shape[self.shard_dim]

    @property
    def inner(self) -> int:
        """Elements per index of the sharded dimension."""
        return self.numel if self.shard_dim is None else self.numel // max(self.dim_size, 1)

    @property
    def chunk(self) -> int:
        """Length of a full chunk along the sharded dimension (torch.chunk's rule)."""
        return -(-self.dim_size // self.world)

    @property
    def slot(self) -> int:
        """Elements reserved per rank: a full chunk."""
        return self.chunk * self.inner

    @property
    def unsharded_offset(self) -> int:
        return self.world * self.local_offset

    def chunk_start(self, rank: int) -> int:
        return min(rank * self.chunk, self.dim_size)

    def chunk_length(self, rank: int) -> int:
        return min(self.dim_size, (rank + 1) * self.chunk) - self.chunk_start(rank)

    def chunk_shape(self, rank: int) -> tuple[int, ...]:
        if self.shard_dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.shard_dim] = self.chunk_length(rank)
        return tuple(shape)

    def chunk_numel(self, rank: int) -> int:
        return self.numel if self.shard_dim is None else self.chunk_length(rank) * self.inner

    @property
    def full_chunks(self) -> int:
        """Ranks whose chunk is full (the rest hold a partial chunk or nothing)."""
        if self.shard_dim is None:
            return 1
        return min(self.world, self.dim_size // self.chunk) if self.chunk else self.world


@dataclass(frozen=True)
class GroupLayout:
    params: tuple[ParamLayout, ...]
    """In the group's parameter order (not necessarily buffer order)."""
    world: int
    shard_numel: int
    """S: elements of each rank's local buffer."""
    staged_numel: int
    """The local-buffer prefix gathered through a staging buffer and copied into
    place; the parameters after it are received straight into their slots."""
    direct: tuple[int, ...]
    """Indices of the parameters received straight into place."""

    @property
    def unsharded_numel(self) -> int:
        return self.world * self.shard_numel

    @property
    def numel(self) -> int:
        """Elements used by parameters, padding excluded."""
        return sum(p.numel for p in self.params)


def build_group_layout(shapes: list[tuple[int, ...]], world: int, shard_dims: list[int | None], *,
                       direct_min_numel: int | None = None, align: int = ALIGN) -> GroupLayout:
    """Place each parameter's chunk slot in the local buffer.

    Parameters whose slot holds at least ``direct_min_numel`` elements and
    that are sharded on dim 0 are gathered straight into place (their chunks
    are contiguous in the unsharded buffer); the rest go first, as one staged
    prefix, so they travel as one message and are copied out. None: every
    parameter is staged.
    """
    if world < 1 or align < 1:
        raise ValueError(f"world ({world}) and align ({align}) must be positive")
    sized = [ParamLayout(tuple(shape), dim, world if dim is not None else 1, 0)
             for shape, dim in zip(shapes, shard_dims)]
    for p in sized:
        if p.shard_dim is not None and p.shard_dim > 0 and p.dim_size % world:
            raise ValueError(f"shape {p.shape}: dimension {p.shard_dim} ({p.dim_size}) does not split evenly "
                             f"over {world} ranks; only dimension 0 may be chunked unevenly")
    if any(p.shard_dim is None for p in sized) and any(p.shard_dim is not None for p in sized):
        raise ValueError("a group is either sharded or replicated, not both")
    direct = [i for i, p in enumerate(sized) if direct_min_numel is not None and p.shard_dim == 0
              and world > 1 and p.slot >= direct_min_numel]
    order = [i for i in range(len(sized)) if i not in direct] + direct
    placed: list[ParamLayout | None] = [None] * len(sized)
    cursor, staged = 0, None
    for i in order:
        if i in direct and staged is None:
            staged = _round_up(cursor, align)
        cursor = _round_up(cursor, align)
        placed[i] = ParamLayout(sized[i].shape, sized[i].shard_dim, sized[i].world, cursor)
        cursor += sized[i].slot
    shard_numel = _round_up(cursor, align)
    return GroupLayout(tuple(placed), sized[0].world if sized else world, shard_numel,
                       shard_numel if staged is None else staged, tuple(direct))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# ---- block alignment ---------------------------------------------------------------------

def check_block(block) -> None:
    if block is None:
        return
    ok = (isinstance(block, int) and not isinstance(block, bool) and block > 0) or (
        isinstance(block, tuple) and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block))
    if not ok:
        raise ValueError(f"shard_block must be a positive number of elements or a (rows, cols) tile, got {block!r}")


def shard_dim_for(shape: tuple[int, ...], world: int, block=None) -> int | None:
    """The dimension to chunk so that no block straddles two ranks, or None
    when no dimension does (the parameter is then kept replicated).

    ``block``: None (no constraint: dim 0), ``B`` (blocks of B consecutive
    elements of the flattened parameter) or ``(R, C)`` (tiles of R rows and C
    columns of the parameter seen as ``(shape[0], numel // shape[0])``).
    Rank boundaries fall on multiples of the chunk, so dim 0 qualifies when its
    chunk is a whole number of blocks (or one rank holds everything), and a
    2-D parameter may instead be split by columns, evenly, in whole tiles.
    """
    if len(shape) == 0:
        return None
    if block is None or world == 1:
        return 0
    rows = ParamLayout(tuple(shape), 0, world, 0)
    if rows.chunk >= rows.dim_size:
        return 0
    if isinstance(block, int):
        return 0 if rows.slot % block == 0 else None
    tile_rows, tile_cols = block
    if rows.chunk % tile_rows == 0:
        return 0
    if len(shape) == 2 and shape[1] % world == 0 and (shape[1] // world) % tile_cols == 0:
        return 1
    return None
