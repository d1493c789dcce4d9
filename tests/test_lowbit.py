"""The block-scaled 8-bit codes low-bit gathers and reductions travel as
(engine/layout/block_formats.py): deterministic, within their error bound,
and independent of how a weight's rows are split between ranks."""

from __future__ import annotations

import pytest
import torch

from flatfsdp.engine.layout.block_formats import (BLOCK_FORMATS, BlockFormat, Fp8E4M3Blocks, Fp8E5M2Blocks,
                                                  Int8Blocks, block_format, dequantize, error_bound, parse_format,
                                                  quantize, quantize_dequantize)

KINDS = sorted(BLOCK_FORMATS)
CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _round_trip(x: torch.Tensor, fmt: BlockFormat, dtype=torch.float32):
    codes = torch.empty(x.shape, dtype=torch.uint8)
    scales = torch.empty(x.shape[0], fmt.blocks(x.shape[1]))
    quantize(x, fmt, codes, scales)
    out = torch.empty(x.shape, dtype=dtype)
    dequantize(codes, scales, fmt, out)
    return codes, scales, out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [7, 64, 100, 101])  # shorter than a block, whole blocks, cut evenly, a short tail
def test_round_trip_is_within_the_bound_of_each_block(kind, n):
    torch.manual_seed(0)
    fmt = block_format(kind, block=32)
    x = torch.randn(5, n) * torch.logspace(-3, 2, 5).unsqueeze(1)  # rows of very different magnitudes
    codes, scales, out = _round_trip(x, fmt)
    assert scales.shape == (5, -(-n // 32))
    width = fmt.width(n)  # 100 = 4 blocks of 25: equal blocks of at most 32
    assert width == {7: 7, 64: 32, 100: 25, 101: 26}[n]  # 101: 3 x 26 + 23
    for b in range(scales.shape[1]):
        cols = slice(b * width, min(n, (b + 1) * width))
        amax = x[:, cols].abs().amax(dim=1, keepdim=True)
        assert torch.allclose(scales[:, b:b + 1], amax / fmt.qmax)
        assert ((out[:, cols] - x[:, cols]).abs() <= error_bound(amax, fmt) * (1 + 1e-6)).all()
    # the largest element of each block is coded at full scale
    assert (codes.view(CODE_DTYPES[kind]).float().abs().amax(dim=1) == fmt.qmax).all()


def test_int8_codes_are_rounded_steps_and_deterministic():
    fmt = Int8Blocks(block=4)
    x = torch.tensor([[1.27, -0.635, 0.0, 0.3], [0.0, 0.0, 0.0, 0.0]])
    codes, scales, out = _round_trip(x, fmt)
    assert codes.view(torch.int8).tolist() == [[127, -64, 0, 30], [0, 0, 0, 0]]  # -63.5 rounds half to even
    assert scales[1].item() == 1.0 and out[1].abs().sum() == 0  # an all-zero block stays zero
    again = _round_trip(x, fmt)
    assert torch.equal(codes, again[0]) and torch.equal(out, again[2])


@pytest.mark.parametrize("kind", ["fp8", "e5m2"])
def test_fp8_decoding_matches_torch_for_every_finite_code(kind):
    fmt = block_format(kind)
    codes = torch.arange(256, dtype=torch.uint8)
    exact = codes.view(CODE_DTYPES[kind]).float()
    finite = torch.isfinite(exact)
    out = torch.empty(1, 256)
    dequantize(codes.view(1, 256), torch.ones(1, 1), fmt, out)
    assert torch.equal(out[0][finite], exact[finite])


@pytest.mark.parametrize("kind", KINDS)
def test_a_weight_round_trips_the_same_however_its_rows_are_split(kind):
    torch.manual_seed(1)
    fmt = block_format(kind, block=16)
    w = torch.randn(10, 40)
    whole = quantize_dequantize(w, fmt)
    for world in (2, 3, 4):
        parts = [quantize_dequantize(chunk, fmt) for chunk in torch.chunk(w, world)]
        assert torch.equal(torch.cat(parts), whole)
    assert torch.equal(quantize_dequantize(torch.ones(7), fmt), torch.ones(7))  # vectors travel as they are
    bf16 = quantize_dequantize(w, fmt, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, whole.to(torch.bfloat16))


def test_formats_are_parsed_or_refused_by_name():
    assert parse_format("int8") == Int8Blocks()
    assert parse_format(torch.float8_e4m3fn, 64) == Fp8E4M3Blocks(64)
    assert parse_format("float8_e5m2") == parse_format(torch.float8_e5m2) == Fp8E5M2Blocks()
    assert parse_format("e5m2") != parse_format("fp8")  # the same block, another format
    assert parse_format(None) is None
    with pytest.raises(ValueError, match="param_gather_dtype='int4'"):
        parse_format("int4")
    with pytest.raises(ValueError, match="block size"):
        Int8Blocks(block=0)


def test_e5m2_codes_are_float8_e5m2_rounding_of_the_scaled_values():
    # e5m2 trades mantissa for range: the code is torch's own rounding of
    # x / scale to float8_e5m2, and its worst error is half a step at the top
    # of the range (4096 of 57344 scales), far coarser than int8's half step.
    torch.manual_seed(5)
    fmt = Fp8E5M2Blocks(block=32)
    x = torch.randn(64, 96) * torch.logspace(-20, 20, 64).unsqueeze(1)
    codes, scales, out = _round_trip(x, fmt)
    scale = scales.repeat_interleave(32, dim=1)
    assert torch.equal(codes.view(torch.float8_e5m2), torch.div(x, scale).to(torch.float8_e5m2))
    assert torch.equal(out, codes.view(torch.float8_e5m2).float() * scale)
    amax = x.abs().view(64, 3, 32).amax(-1).repeat_interleave(32, dim=1)
    assert ((out - x).abs() <= error_bound(amax, fmt) * (1 + 1e-6)).all()
    assert error_bound(torch.tensor(57344.0), fmt) == 4096 and error_bound(torch.tensor(127.0), Int8Blocks()) == 0.5


def test_int8_codes_need_no_clamp_at_the_block_maximum():
    # Every block's largest magnitude divided by its scale lands a float
    # rounding away from 127; rounding must bring it back (never 128 or -128).
    torch.manual_seed(2)
    fmt = Int8Blocks(block=8)
    x = torch.randn(4096, 8) * torch.logspace(-30, 30, 4096).unsqueeze(1)
    x[::2] = -x[::2]
    codes, scales, _ = _round_trip(x, fmt)
    reference = torch.div(x, scales).clamp(-127, 127).round()
    assert torch.equal(codes.view(torch.int8).float(), reference)
    assert codes.view(torch.int8).abs().amax(dim=1).eq(127).all()


@pytest.mark.parametrize("kind", KINDS)
def test_accumulating_dequantize_adds_exactly_what_a_decode_would(kind):
    # The block-scaled gradient sum decodes each peer's codes piecewise into
    # the total; it must add bit for bit what a whole decode, then an add, would.
    from flatfsdp.engine.layout.block_formats import dequantize_flat, quantize_flat

    torch.manual_seed(3)
    fmt = block_format(kind, block=64)
    n = 300_001  # several passes of rows and a short tail block
    x = torch.randn(n)
    codes = torch.empty(n, dtype=torch.uint8)
    scales = torch.empty(fmt.blocks(n))
    quantize_flat(x, fmt, codes, scales)
    decoded = torch.empty(n)
    dequantize_flat(codes, scales, fmt, decoded)
    total = torch.randn(n)
    expected = total + decoded
    dequantize_flat(codes, scales, fmt, total, accumulate=True)
    assert torch.equal(total, expected)
