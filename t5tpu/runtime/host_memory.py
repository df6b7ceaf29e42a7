"""Host allocator settings that keep freed memory in the process for the next step to reuse.

XLA's CPU runtime allocates a program's temporaries as one block per execution (hundreds of MB
for a train step) from a worker thread. glibc serves such a block from a thread's own arena only
up to 64 MB, so it maps fresh pages for it and unmaps them on free: every step then faults in
and zero-fills all of them again, in kernel time. With one arena (the main one, which grows
without that limit), no mmap below 2 GiB and no trimming, a step reuses the previous step's
pages instead (docs/PERFORMANCE.md, "Changes", has the measurements).

The cost is that the process keeps its peak heap instead of returning freed memory to the
kernel, which a training or decoding process reaches within a step anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt(3) parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_INT_MAX = 2**31 - 1  # mallopt takes an int


def keep_freed_memory() -> bool:
    """Applies the settings; must run before the process starts threads (arenas are per thread).
    Returns False where the C library is not glibc (the settings do not exist there)."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name)
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, _INT_MAX), (_M_TRIM_THRESHOLD, -1))
    return all(libc.mallopt(param, value) == 1 for param, value in settings)
