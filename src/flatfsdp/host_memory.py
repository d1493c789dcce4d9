"""Give freed host memory back to the operating system between steps.

On CPU every transient buffer (gathered weights, unsharded gradients, staging)
is a malloc of megabytes. glibc serves the first ones with mmap and returns
them on free, but each such free raises its mmap threshold (up to 32 MiB), so
later buffers come from the heap, and freed heap memory stays resident: the
process grows by the fragmentation of every step. ``malloc_trim(0)`` hands back
every whole free page, which is all the engine's transients once a step is
over. It costs about a millisecond and changes no value. Measured on the
benchmark model (33.7M parameters, 2 ranks, fp32, small batch): peak resident
memory 739 -> 639 MB above the pre-model baseline.

Only where the C library is glibc and the engine's buffers live in host
memory; FLATFSDP_MALLOC_TRIM=0 turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from functools import lru_cache


@lru_cache(maxsize=None)
def _malloc_trim():
    if os.environ.get("FLATFSDP_MALLOC_TRIM", "1") == "0":
        return None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
        return None


def release_free_host_memory() -> bool:
    """Return free heap pages to the OS; False where that is not possible."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
