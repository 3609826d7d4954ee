"""Keep glibc from returning large temporaries to the OS after every step.

glibc serves allocations above a (dynamic) threshold with ``mmap`` and gives
them back with ``munmap`` on free, so every training step pays page faults to
map its weight-sized temporaries again; here that tripled the time of a small
MLP step. Raising the mmap threshold (to its maximum, 32 MiB on 64-bit) and
the trim threshold keeps freed blocks in the heap for the next step, as the
caching allocators of other frameworks do. Freed memory then stays with the
process instead of going back to the OS.

Done once at import, only on glibc; set ``MONADL_TUNE_MALLOC=0`` to opt out.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["malloc_tuned", "tune_malloc"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
_TRIM_THRESHOLD = 1024 * 1024 * 1024

malloc_tuned = False


def tune_malloc() -> bool:
    """Apply the tuning; returns whether it took effect (glibc only)."""
    global malloc_tuned  # a one-way, process-wide fact, like the allocator it describes
    if malloc_tuned:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    malloc_tuned = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )
    return malloc_tuned


if os.environ.get("MONADL_TUNE_MALLOC", "1") != "0":
    tune_malloc()
