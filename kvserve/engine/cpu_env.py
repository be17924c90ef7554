"""Process-level tuning for CPU inference.

glibc's malloc returns large freed blocks to the kernel (mmap'd chunks, heap trimming), so
every engine step re-faults and re-zeroes the pages of its multi-MB activations — this
doubled prefill time in our benchmark. ``tune_malloc`` keeps such memory in the process,
the effect vLLM's CPU docs get by preloading tcmalloc. It changes allocator behaviour for
the whole process, which is what a dedicated serving process wants; set
``KVSERVE_NO_MALLOC_TUNING=1`` to leave malloc alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 512 * 1024 * 1024  # glibc's ceiling for this parameter on 64-bit
_TRIM_THRESHOLD = 2 * 1024**3
_TOP_PAD = 256 * 1024 * 1024


def tune_malloc() -> bool:
    """Apply the settings once per process; True if glibc accepted them."""
    if os.environ.get("KVSERVE_NO_MALLOC_TUNING") == "1":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD),
            (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD),
            (_M_TOP_PAD, _TOP_PAD),
        )
    )
    if not ok:
        logger.debug("mallopt refused the CPU allocator settings")
    return ok
