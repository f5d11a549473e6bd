"""Keeps the host allocator from handing memory back to the OS between steps (and has it do so
once, after loading).

Every step allocates and frees the same activations. glibc serves blocks above its mmap threshold
with fresh mappings and trims freed memory at the top of the heap, so each step pays the page
faults of its activations again (~15% of a SmolLM2 run on 2 cores, measured with
scripts/bench.py). Raising both thresholds once keeps freed blocks for reuse; the price is that
the process's RSS stays at its peak, which a batch engine reaches anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit systems
_TRIM_THRESHOLD = 1 << 30


def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc (musl has neither mallopt nor malloc_trim), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def retain_freed_memory() -> bool:
    """Applies the settings when the C library is glibc; returns whether it did."""
    if (libc := _glibc()) is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))


def release_freed_memory() -> bool:
    """Hands the heap's free memory back to the OS once (glibc's malloc_trim), for after loading: the
    checkpoint's unpacked weights and the packing's copies are freed by then, and with the settings
    above the heap would keep them for good (SmolLM2: ~0.25 GB of RSS). Returns whether it ran."""
    if (libc := _glibc()) is None:
        return False
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    libc.malloc_trim(0)
    return True
