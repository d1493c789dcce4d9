"""Block-scaled 8-bit codes: what low-bit weight gathers and gradient
reductions put on the wire (Note [low-bit blocks]).

A tensor is read as rows (its trailing elements: a weight matrix's rows, a
gradient buffer's per-rank chunk) cut into ``ceil(n / block)`` blocks of
equal width ``ceil(n / blocks)`` (at most ``block``; only the last block of a
row may be shorter, and only when no equal width divides the row). A row of
384 with ``block=256`` is two blocks of 192, not 256 + 128: a weight's codes
are then one contiguous (rows * blocks, width) array, processed in single
passes instead of a strided pass per part. Each block gets one fp32
scale, ``amax / qmax``, and each element one byte, as its format says:

* ``int8``: ``round(x / scale)`` in [-127, 127] (round half to even);
* ``fp8``: ``x / scale`` rounded to float8 e4m3 (max 448), stored as its byte;
* ``e5m2``: ``x / scale`` rounded to float8 e5m2 (max 57344): two mantissa
  bits for five exponent bits, a coarser grid over a far wider range.

A format is one ``BlockFormat`` subclass (its byte encoding and exact
decoding) plus its line in ``BLOCK_FORMATS``; nothing else names formats.
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
from typing import ClassVar

import torch
from torch._subclasses.fake_tensor import FakeTensor

DEFAULT_BLOCK = 256
"""Elements per scale. Measured on the bench GPT (docs/lowbit.md): 4 scale
bytes per 256 codes is 1.6% on top of the codes, and the relative error of
int8 weights is 0.4% (block 64: 0.35% for 6% more bytes; 1024: 0.5%)."""


@dataclass(frozen=True)
class BlockFormat:
    """A block-scaled 8-bit format and its block size."""

    block: int = DEFAULT_BLOCK
    name: ClassVar[str]
    qmax: ClassVar[float]
    """The largest code magnitude: a block's amax maps to it."""
    half_step: ClassVar[float]
    """Half the grid step at ``qmax``, in units of the scale: the largest
    rounding error of one element (``error_bound``)."""
    decode_factor: ClassVar[float] = 1.0
    """``decode`` yields the values divided by this (exactly: a power of two)."""

    def __post_init__(self) -> None:
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 1:
            raise ValueError(f"low-bit block size must be a positive number of elements, got {self.block!r}")

    def blocks(self, n: int) -> int:
        """Scales per row of ``n`` elements."""
        return -(-n // self.block)

    def width(self, n: int) -> int:
        """Elements per block in a row of ``n`` (the last block may be shorter)."""
        return -(-n // self.blocks(n)) if n else self.block

    def row_bytes(self, n: int) -> int:
        """Bytes of one row of ``n`` elements on the wire: codes and scales."""
        return n + 4 * self.blocks(n)

    def encode(self, scaled: torch.Tensor, out: torch.Tensor) -> None:
        """``scaled`` (``x / scale``, within [-qmax, qmax] up to rounding; may
        be overwritten) as codes into the uint8 tensor ``out``."""
        raise NotImplementedError

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """The uint8 ``codes`` as exact values divided by ``decode_factor``
        (a tensor any float destination can copy from)."""
        raise NotImplementedError


class Int8Blocks(BlockFormat):
    name, qmax, half_step = "int8", 127.0, 0.5

    def encode(self, scaled: torch.Tensor, out: torch.Tensor) -> None:
        # |x| <= amax, so |x / scale| exceeds 127 by float rounding at most,
        # and rounds to 127: no clamp pass needed.
        out.view(torch.int8).copy_(scaled.round_())

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.view(torch.int8)


class Fp8E4M3Blocks(BlockFormat):
    # 448 = 1.75 * 2**8 with 3 mantissa bits: the top binade's step is 32.
    name, qmax, half_step, decode_factor = "fp8", 448.0, 16.0, 256.0

    def encode(self, scaled: torch.Tensor, out: torch.Tensor) -> None:
        out.view(torch.float8_e4m3fn).copy_(scaled.clamp_(-self.qmax, self.qmax))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """e4m3 bytes as fp16 values 2**-8 times theirs (exact, subnormals
        included): the byte's exponent and mantissa bits moved into fp16's
        places. torch's own float8 -> float conversion runs 4x slower on CPU."""
        wide = codes.to(torch.int16)
        sign = torch.bitwise_and(wide, 0x80).bitwise_left_shift_(8)
        return wide.bitwise_and_(0x7F).bitwise_left_shift_(7).bitwise_or_(sign).view(torch.float16)


class Fp8E5M2Blocks(BlockFormat):
    # 57344 = 1.75 * 2**15 with 2 mantissa bits: the top binade's step is 8192.
    name, qmax, half_step = "e5m2", 57344.0, 4096.0

    def encode(self, scaled: torch.Tensor, out: torch.Tensor) -> None:
        out.view(torch.float8_e5m2).copy_(scaled.clamp_(-self.qmax, self.qmax))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """An e5m2 byte is the top byte of the fp16 of the same value (same
        exponent bias, mantissa cut to two bits): shifted up, exact."""
        return codes.to(torch.int16).bitwise_left_shift_(8).view(torch.float16)


BLOCK_FORMATS: dict[str, type[BlockFormat]] = {
    "int8": Int8Blocks,
    "fp8": Fp8E4M3Blocks,
    "e5m2": Fp8E5M2Blocks,
}
"""Every block-scaled format, by the name the keywords take."""

_ALIASES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8", "float8_e4m3fn": "fp8", "e4m3": "fp8",
            "fp8_e4m3": "fp8", torch.float8_e5m2: "e5m2", "float8_e5m2": "e5m2", "fp8_e5m2": "e5m2"}


def block_format(name: str, block: int = DEFAULT_BLOCK) -> BlockFormat:
    """The format named ``name`` (a key of BLOCK_FORMATS)."""
    if name not in BLOCK_FORMATS:
        raise ValueError(f"low-bit format {name!r}: expected one of {', '.join(BLOCK_FORMATS)}")
    return BLOCK_FORMATS[name](block)


def parse_format(value, block: int | None = None, *, what: str = "param_gather_dtype") -> BlockFormat | None:
    """A name of BLOCK_FORMATS, an alias (``"float8_e4m3fn"``, ``"e4m3"``,
    ``"float8_e5m2"``) or a torch dtype (``torch.int8``, ``torch.float8_e4m3fn``,
    ``torch.float8_e5m2``); None: no low-bit format."""
    if value is None:
        return None
    name = value if isinstance(value, str) and value in BLOCK_FORMATS else (
        _ALIASES.get(value) if isinstance(value, (str, torch.dtype)) else None)
    if name is None:
        raise ValueError(f"{what}={value!r}: expected one of {', '.join(BLOCK_FORMATS)} (block-scaled codes), "
                         "or torch.int8 / torch.float8_e4m3fn / torch.float8_e5m2")
    return block_format(name, DEFAULT_BLOCK if block is None else block)


_ROWS_AT_ONCE = 1 << 18
"""Elements quantized per pass on a host CPU: the temporaries stay in cache
and in the allocator's pool (fresh multi-MB temporaries cost more in page
faults than the arithmetic). An accelerator takes one pass (each pass is a
few kernel launches), and so do fake tensors (the estimator: each pass is a
few dispatches of pure overhead -- 8B at int8 took over 30 minutes)."""


def passes_in_cache(x: torch.Tensor) -> bool:
    """Whether ``x``'s rows are worked through in cache-sized passes (real host memory)."""
    return x.device.type == "cpu" and not isinstance(x, FakeTensor)


def _split(x: torch.Tensor, fmt: BlockFormat) -> list[tuple[torch.Tensor, slice]]:
    """(rows of whole blocks as (rows, nb, width), scale columns) and the
    short tail block as (rows, 1, tail): views of ``x`` (rows, n; or with
    more leading dimensions, as several ranks' rows at once)."""
    n = x.shape[-1]
    block = fmt.width(n)
    full = n // block
    parts = []
    if full:
        parts.append((x[..., :full * block].unflatten(-1, (full, block)), slice(0, full)))
    if n % block:
        parts.append((x[..., full * block:].unsqueeze(-2), slice(full, full + 1)))
    return parts


def _row_ranges(x: torch.Tensor) -> list[slice]:
    """Passes over ``x``'s leading dimension: cache-sized ones on a host CPU
    (``passes_in_cache``), else one."""
    rows = x.shape[0]
    n = x.numel() // max(rows, 1)
    if not passes_in_cache(x):
        return [slice(0, rows)]
    step = max(1, _ROWS_AT_ONCE // max(n, 1))
    return [slice(r, min(rows, r + step)) for r in range(0, rows, step)]


def quantize(x: torch.Tensor, fmt: BlockFormat, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Codes (uint8, ``x``'s shape) and scales (fp32, (rows, blocks(n))) of
    ``x`` (rows, n), written into the given tensors (views of a wire row)."""
    for rows in _row_ranges(x):
        parts = zip(_split(x[rows], fmt), _split(codes[rows], fmt))
        for (values, cols), (out, _) in parts:
            amax = torch.maximum(values.amax(dim=-1, keepdim=True), values.amin(dim=-1, keepdim=True).neg_())
            scale = amax.float().div_(fmt.qmax)
            scale = torch.where(scale > 0, scale, 1.0)  # an all-zero block codes as zeros
            scales[rows][..., cols].copy_(scale.squeeze(-1))
            fmt.encode(torch.div(values, scale), out)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: BlockFormat, out: torch.Tensor,
               *, accumulate: bool = False) -> None:
    """``out`` (rows, n) = float32(code) * scale, rounded into ``out``'s
    dtype. The codes are decoded into ``out`` exactly (8-bit values fit any
    float dtype) and scaled in place: vectorised passes, no large temporary.
    ``accumulate``: ``out += `` the same values instead (decoded into a
    cache-sized temporary per pass: a gradient sum needs no decoded copy of
    the whole chunk, whose fresh pages cost more than the arithmetic)."""
    for rows in _row_ranges(codes):
        parts = zip(_split(codes[rows], fmt), _split(out[rows], fmt))
        for (c, cols), (o, _) in parts:
            scale = scales[rows][..., cols].unsqueeze(-1)
            target = torch.empty(o.shape, dtype=o.dtype, device=o.device) if accumulate else o
            target.copy_(fmt.decode(c))
            target.mul_(scale if fmt.decode_factor == 1.0 else scale * fmt.decode_factor)
            if accumulate:
                o.add_(target)


def _flat_parts(x: torch.Tensor, block: int) -> list[tuple[torch.Tensor, slice]]:
    """A 1-D tensor as (whole blocks, one a row) and its short tail (one row)."""
    full = x.numel() // block
    parts = []
    if full:
        parts.append((x[:full * block].view(full, block), slice(0, full)))
    if x.numel() % block:
        parts.append((x[full * block:].view(1, -1), slice(full, full + 1)))
    return parts


def quantize_flat(x: torch.Tensor, fmt: BlockFormat, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """A 1-D tensor in consecutive blocks (a gradient chunk: blocks may span
    parameters); ``scales`` holds ``fmt.blocks(x.numel())`` values."""
    for (values, cols), (c, _) in zip(_flat_parts(x, fmt.block), _flat_parts(codes, fmt.block)):
        quantize(values, fmt, c, scales[cols].view(-1, 1))


def dequantize_flat(codes: torch.Tensor, scales: torch.Tensor, fmt: BlockFormat, out: torch.Tensor,
                    *, accumulate: bool = False) -> None:
    for (c, cols), (o, _) in zip(_flat_parts(codes, fmt.block), _flat_parts(out, fmt.block)):
        dequantize(c, scales[cols].view(-1, 1), fmt, o, accumulate=accumulate)


def quantize_dequantize(x: torch.Tensor, fmt: BlockFormat, dtype: torch.dtype | None = None) -> torch.Tensor:
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


def error_bound(amax: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The largest |x - dequantize(quantize(x))| of a block whose largest
    magnitude is ``amax`` (before rounding into the destination dtype):
    half the grid step at the top of the format's range, in scales."""
    return amax / fmt.qmax * fmt.half_step
