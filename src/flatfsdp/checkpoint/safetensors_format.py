"""The safetensors format, written one tensor at a time and read without the
safetensors package.

The format is simple: an 8-byte little-endian header length, a JSON header
mapping each name to dtype, shape and [begin, end) byte offsets into the data
section (padded with spaces to 8-byte alignment), then the raw little-endian
bytes of each tensor. The safetensors Python API takes or returns a whole dict;
exporting a model larger than memory needs the format itself: every shape and
dtype is known from the DCP metadata up front, so the header is written first
and tensors follow as they are loaded. Reading maps the file (copy-on-write,
so nothing is loaded until used and the file is never written; a reader that
needs one rank's rows of a tensor reads only their pages) and checks
every header entry against the file before a tensor is made from it: a header
is untrusted JSON, never code.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import sys

import torch

from flatfsdp.checkpoint.errors import CheckpointError

DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}

CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
MAX_HEADER_BYTES = 100 << 20
"""A larger header is not a safetensors file (the reference reader caps it too)."""


def _nbytes(dtype: torch.dtype, shape) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel * dtype.itemsize


class SafetensorsStreamWriter:
    """Write ``specs`` ([(name, dtype, shape)], in that order) to an open binary file."""

    def __init__(self, file, specs: list[tuple[str, torch.dtype, tuple]], metadata: dict[str, str] | None = None):
        if sys.byteorder != "little":
            raise CheckpointError("safetensors export needs a little-endian machine")
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        for name, dtype, shape in specs:
            if dtype not in DTYPE_CODES:
                raise CheckpointError(f"{name}: dtype {dtype} has no safetensors code")
            end = offset + _nbytes(dtype, shape)
            header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
            offset = end
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        self._file = file
        self._specs = [(name, dtype, tuple(shape)) for name, dtype, shape in specs]
        self._written = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor; it must match the next spec exactly."""
        if self._written == len(self._specs):
            raise ValueError(f"{name}: every declared tensor was already written")
        expected = self._specs[self._written]
        if (name, tensor.dtype, tuple(tensor.shape)) != expected:
            raise ValueError(f"expected {expected}, got {(name, tensor.dtype, tuple(tensor.shape))}")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        self._file.write(_bytes_view(flat))
        self._written += 1

    def close(self) -> None:
        if self._written != len(self._specs):
            missing = len(self._specs) - self._written
            raise ValueError(f"{missing} declared tensors were never written, first {self._specs[self._written][0]}")


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy and without numpy
    (``Tensor.numpy()`` needs it; torch itself does not)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class SafetensorsFile:
    """One .safetensors file, opened lazily: the header is read and checked now;
    ``tensor(name)`` is a view of a private memory map of the file, so only the
    pages of the elements a caller touches are ever read (slicing a view first
    reads only that slice). Raises CheckpointError naming the file if anything
    in it does not add up (truncation, bad header, offsets outside the data)."""

    def __init__(self, path: str):
        if sys.byteorder != "little":
            raise CheckpointError("reading safetensors needs a little-endian machine")
        self.path = path
        size = os.path.getsize(path)
        if size < 8:
            raise self._corrupted(f"{size} bytes, shorter than the 8-byte header length")
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise self._corrupted(f"header length {header_len} exceeds the file")
            try:
                header = json.loads(f.read(header_len))
            except (UnicodeDecodeError, ValueError) as exc:
                raise self._corrupted(f"header is not JSON: {exc}") from None
            if not isinstance(header, dict):
                raise self._corrupted("header is not a JSON object")
            self._data_start, data_len = 8 + header_len, size - 8 - header_len
            self.entries: dict[str, tuple[torch.dtype, tuple, int, int]] = {
                name: _checked_entry(name, spec, data_len, self._corrupted)
                for name, spec in header.items() if name != "__metadata__"}
            """name -> (dtype, shape, begin, end): the checked header."""
            self._raw = None
            if self.entries:
                # ACCESS_COPY: writable (torch.frombuffer needs that) but private, so
                # nothing ever reaches the file; pages load on first touch.
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                self._raw = torch.frombuffer(mapped, dtype=torch.uint8)

    def _corrupted(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: truncated or corrupted safetensors file ({why})")

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name``: a view of the map (nothing read yet), or -- where
        its offset does not suit its dtype -- a copy."""
        dtype, shape, begin, end = self.entries[name]
        piece = self._raw[self._data_start + begin:self._data_start + end]
        if (self._data_start + begin) % dtype.itemsize:
            piece = piece.clone()  # views of another dtype need aligned offsets
        return piece.view(dtype).view(shape)

    def is_aligned(self, name: str) -> bool:
        dtype, _shape, begin, _end = self.entries[name]
        return (self._data_start + begin) % dtype.itemsize == 0


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of a .safetensors file, the tensors backed by a private
    memory map of it (see SafetensorsFile)."""
    file = SafetensorsFile(path)
    return {name: file.tensor(name) for name in file.entries}


def _checked_entry(name: str, spec, data_len: int, corrupted) -> tuple[torch.dtype, tuple, int, int]:
    if not isinstance(spec, dict):
        raise corrupted(f"entry {name!r} is not an object")
    dtype = CODE_DTYPES.get(spec.get("dtype"))
    shape, offsets = spec.get("shape"), spec.get("data_offsets")
    if dtype is None:
        raise corrupted(f"entry {name!r} has unknown dtype {spec.get('dtype')!r}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise corrupted(f"entry {name!r} has shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise corrupted(f"entry {name!r} has data_offsets {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len or end - begin != _nbytes(dtype, shape):
        raise corrupted(f"entry {name!r}: bytes [{begin}, {end}) do not hold {dtype} {tuple(shape)} "
                        f"inside {data_len} data bytes")
    return dtype, tuple(shape), begin, end
