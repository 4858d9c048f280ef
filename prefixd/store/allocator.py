"""Process-wide malloc settings that let LMDB reuse its write buffers.

LMDB mallocs the dirty pages of each large value for the length of a write transaction and frees
them at commit. With glibc's defaults that memory goes back to the OS after each commit, so the next
put faults every page in again (5-7 us per 4 KiB page on the development VM), which caps puts near
0.7 GB/s. Keeping freed memory in the heap (large allocations from the heap, no trimming below the
threshold) measured 0.67 -> 0.94 GB/s for 1 MiB payloads in 64-block puts.

This changes the whole process, so the library never calls it by itself: `prefixd serve` (the
process owner) does, and so do the benchmarks; an engine embedding the store may call it too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest: allocations below this come from the heap
TRIM_THRESHOLD = 512 << 20  # freed heap memory kept for reuse, at most this much
TOP_PAD = 64 << 20


def keep_write_buffers() -> bool:
    """Apply the settings above; False where the C library is not glibc (nothing changes)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    applied = all(
        mallopt(option, value) == 1
        for option, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (_M_TOP_PAD, TOP_PAD),
        )
    )
    if not applied:
        log.debug("mallopt refused a setting; LMDB write buffers are not kept")
    return applied
