"""Block-scaled 8-bit codes: what low-bit weight gathers and gradient
reductions put on the wire (Note [low-bit blocks]).

A tensor is read as rows (its trailing elements: a weight matrix's rows, a
gradient buffer's per-rank chunk) cut into ``ceil(n / block)`` blocks of
equal width ``ceil(n / blocks)`` (at most ``block``; only the last block of a
row may be shorter, and only when no equal width divides the row). A row of
384 with ``block=256`` is two blocks of 192, not 256 + 128: a weight's codes
are then one contiguous (rows * blocks, width) array, processed in single
passes instead of a strided pass per part. Each block gets one fp32
scale, ``amax / qmax``, and each element one byte:

* ``int8``: ``round(x / scale)`` clamped to [-127, 127] (round half to even);
* ``fp8``: ``x / scale`` rounded to float8 e4m3 (max 448), stored as its byte.

Codes travel as ``uint8`` whatever the format, so every backend carries them
(gloo has no float8 type). Dequantizing is ``float32(code) * scale``, rounded
once into the destination's dtype. Everything here is elementwise or a
per-block max -- deterministic on every device -- so applying
``quantize_dequantize`` to an unsharded model's weights reproduces, bit for
bit, what a sharded model computes with after a low-bit gather.

Note [low-bit blocks]: blocks never cross a row, and a weight's rows are
never split between ranks (chunks are whole dim-0 rows), so a weight's codes
do not depend on the world size or on which rank holds which rows; an
HFSDP piece's codes are the same bytes as its rows' codes in the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_BLOCK = 256
"""Elements per scale. Measured on the bench GPT (docs/lowbit.md): 4 scale
bytes per 256 codes is 1.6% on top of the codes, and the relative error of
int8 weights is 0.4% (block 64: 0.35% for 6% more bytes; 1024: 0.5%)."""

_FP8 = torch.float8_e4m3fn
_QMAX = {"int8": 127.0, "fp8": 448.0}


@dataclass(frozen=True)
class LowBitFormat:
    """An 8-bit format and its block size."""

    kind: str
    """"int8" or "fp8" (float8 e4m3)."""
    block: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        if self.kind not in _QMAX:
            raise ValueError(f"low-bit format {self.kind!r}: expected 'int8' or 'fp8'")
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 1:
            raise ValueError(f"low-bit block size must be a positive number of elements, got {self.block!r}")

    @property
    def qmax(self) -> float:
        return _QMAX[self.kind]

    def blocks(self, n: int) -> int:
        """Scales per row of ``n`` elements."""
        return -(-n // self.block)

    def width(self, n: int) -> int:
        """Elements per block in a row of ``n`` (the last block may be shorter)."""
        return -(-n // self.blocks(n)) if n else self.block

    def row_bytes(self, n: int) -> int:
        """Bytes of one row of ``n`` elements on the wire: codes and scales."""
        return n + 4 * self.blocks(n)


def parse_format(value, block: int | None = None, *, what: str = "param_gather_dtype") -> LowBitFormat | None:
    """``"int8"``, ``"fp8"`` (or ``"float8_e4m3fn"``), ``torch.int8``,
    ``torch.float8_e4m3fn``; None: no low-bit format."""
    if value is None:
        return None
    names = {torch.int8: "int8", _FP8: "fp8", "int8": "int8", "fp8": "fp8", "float8_e4m3fn": "fp8",
             "e4m3": "fp8"}
    kind = names.get(value) if isinstance(value, (str, torch.dtype)) else None
    if kind is None:
        raise ValueError(f"{what}={value!r}: expected 'int8', 'fp8' (float8 e4m3), torch.int8 or "
                         "torch.float8_e4m3fn")
    return LowBitFormat(kind, DEFAULT_BLOCK if block is None else block)


_ROWS_AT_ONCE = 1 << 18
"""Elements quantized per pass: the temporaries stay in cache and in the
allocator's pool (fresh multi-MB temporaries cost more in page faults than
the arithmetic)."""


def _split(x: torch.Tensor, fmt: LowBitFormat) -> list[tuple[torch.Tensor, slice]]:
    """(rows of whole blocks as (rows, nb, width), scale columns) and the
    short tail block as (rows, 1, tail): views of ``x`` (rows, n)."""
    n = x.shape[-1]
    block = fmt.width(n)
    full = n // block
    parts = []
    if full:
        parts.append((x[:, :full * block].unflatten(-1, (full, block)), slice(0, full)))
    if n % block:
        parts.append((x[:, full * block:].unsqueeze(-2), slice(full, full + 1)))
    return parts


def _row_ranges(rows: int, n: int) -> list[slice]:
    step = max(1, _ROWS_AT_ONCE // max(n, 1))
    return [slice(r, min(rows, r + step)) for r in range(0, rows, step)]


def quantize(x: torch.Tensor, fmt: LowBitFormat, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Codes (uint8, ``x``'s shape) and scales (fp32, (rows, blocks(n))) of
    ``x`` (rows, n), written into the given tensors (views of a wire row)."""
    for rows in _row_ranges(x.shape[0], x.shape[-1]):
        parts = zip(_split(x[rows], fmt), _split(codes[rows], fmt))
        for (values, cols), (out, _) in parts:
            amax = torch.maximum(values.amax(dim=-1, keepdim=True), values.amin(dim=-1, keepdim=True).neg_())
            scale = amax.float().div_(fmt.qmax)
            scale = torch.where(scale > 0, scale, 1.0)  # an all-zero block codes as zeros
            scales[rows, cols].copy_(scale.squeeze(-1))
            scaled = torch.div(values, scale)
            if fmt.kind == "int8":
                # |x| <= amax, so |x / scale| exceeds 127 by float rounding at
                # most, and rounds to 127: no clamp pass needed.
                out.view(torch.int8).copy_(scaled.round_())
            else:
                out.view(_FP8).copy_(scaled.clamp_(-fmt.qmax, fmt.qmax))


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: LowBitFormat, out: torch.Tensor,
               *, accumulate: bool = False) -> None:
    """``out`` (rows, n) = float32(code) * scale, rounded into ``out``'s
    dtype. The codes are decoded into ``out`` exactly (8-bit values fit any
    float dtype) and scaled in place: vectorised passes, no large temporary.
    ``accumulate``: ``out += `` the same values instead (decoded into a
    cache-sized temporary per pass: a gradient sum needs no decoded copy of
    the whole chunk, whose fresh pages cost more than the arithmetic)."""
    for rows in _row_ranges(codes.shape[0], codes.shape[-1]):
        parts = zip(_split(codes[rows], fmt), _split(out[rows], fmt))
        for (c, cols), (o, _) in parts:
            scale = scales[rows, cols].unsqueeze(-1)
            target = torch.empty(o.shape, dtype=o.dtype, device=o.device) if accumulate else o
            if fmt.kind == "int8":
                target.copy_(c.view(torch.int8))
            else:
                target.copy_(_fp8_as_fp16(c))
                scale = scale * _FP8_AS_FP16_FACTOR
            target.mul_(scale)
            if accumulate:
                o.add_(target)


_FP8_AS_FP16_FACTOR = 256.0


def _fp8_as_fp16(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes as fp16 values 2**-8 times theirs (exact, subnormals
    included): the byte's exponent and mantissa bits moved into fp16's
    places. torch's own float8 -> float conversion runs 4x slower on CPU."""
    wide = codes.to(torch.int16)
    sign = torch.bitwise_and(wide, 0x80).bitwise_left_shift_(8)
    return wide.bitwise_and_(0x7F).bitwise_left_shift_(7).bitwise_or_(sign).view(torch.float16)


def _flat_parts(x: torch.Tensor, block: int) -> list[tuple[torch.Tensor, slice]]:
    """A 1-D tensor as (whole blocks, one a row) and its short tail (one row)."""
    full = x.numel() // block
    parts = []
    if full:
        parts.append((x[:full * block].view(full, block), slice(0, full)))
    if x.numel() % block:
        parts.append((x[full * block:].view(1, -1), slice(full, full + 1)))
    return parts


def quantize_flat(x: torch.Tensor, fmt: LowBitFormat, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """A 1-D tensor in consecutive blocks (a gradient chunk: blocks may span
    parameters); ``scales`` holds ``fmt.blocks(x.numel())`` values."""
    for (values, cols), (c, _) in zip(_flat_parts(x, fmt.block), _flat_parts(codes, fmt.block)):
        quantize(values, fmt, c, scales[cols].view(-1, 1))


def dequantize_flat(codes: torch.Tensor, scales: torch.Tensor, fmt: LowBitFormat, out: torch.Tensor,
                    *, accumulate: bool = False) -> None:
    for (c, cols), (o, _) in zip(_flat_parts(codes, fmt.block), _flat_parts(out, fmt.block)):
        dequantize(c, scales[cols].view(-1, 1), fmt, o, accumulate=accumulate)


def quantize_dequantize(x: torch.Tensor, fmt: LowBitFormat, dtype: torch.dtype | None = None) -> torch.Tensor:
    """What ``x`` becomes after a low-bit round trip, as a weight gather does
    it (rows = ``x``'s trailing dimensions past dim 0; vectors and scalars are
    not quantized and come back as they are). For references and tests."""
    dtype = dtype or x.dtype
    if x.dim() < 2:
        return x.detach().to(dtype, copy=True)
    rows = x.detach().reshape(x.shape[0], -1)
    codes = torch.empty(rows.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows.shape[0], fmt.blocks(rows.shape[1]), dtype=torch.float32, device=x.device)
    quantize(rows, fmt, codes, scales)
    out = torch.empty(rows.shape, dtype=dtype, device=x.device)
    dequantize(codes, scales, fmt, out)
    return out.view(x.shape)


def error_bound(amax: torch.Tensor, fmt: LowBitFormat) -> torch.Tensor:
    """The largest |x - dequantize(quantize(x))| of a block whose largest
    magnitude is ``amax`` (before rounding into the destination dtype):
    half a step for int8; for fp8 half a unit in the last place at the top
    binade (3 mantissa bits: 2**-4 of 256 * scale ... 32 * scale at 448)."""
    scale = amax / fmt.qmax
    return scale * (0.5 if fmt.kind == "int8" else 16.0)
