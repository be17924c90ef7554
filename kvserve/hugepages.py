"""Large CPU tensors on transparent huge pages.

A decode step streams every weight and much of the KV cache once. With 4 KiB pages, each
2 MiB of that is 512 TLB entries, far more than a core holds, and the KV cache is read in
block-sized pieces scattered over all of it, so page walks add up. Linux backs an
anonymous mapping with 2 MiB pages where it is advised to (``MADV_HUGEPAGE``; the usual
THP mode is ``madvise``, where nothing else gets them). ``huge_zeros`` gives a tensor its
own such mapping, aligned to 2 MiB. Fresh mappings matter: memory an allocator hands back
(tcmalloc, glibc's free lists) is already faulted in 4 KiB pages, and advising it later
changes nothing until the kernel's background collapse gets to it.

``KVSERVE_HUGEPAGES=0`` in the environment turns this off (plain ``torch.zeros``), for
comparisons and for systems where THP misbehaves.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
# below this a tensor keeps the allocator's pages: a 2 MiB page for a small tensor wastes
# most of it (huge_arena packs many small ones into one mapping instead)
MIN_BYTES = 4 << 20


def enabled() -> bool:
    """True unless ``KVSERVE_HUGEPAGES=0`` or the platform has no ``MADV_HUGEPAGE``."""
    return os.environ.get("KVSERVE_HUGEPAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def _mapped_bytes(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` zeroed bytes at a 2 MiB boundary of a fresh anonymous mapping advised as
    huge pages and faulted in, as a uint8 tensor that keeps the mapping alive; None when
    madvise fails."""
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to align the start
    # private: a shared anonymous mapping is shmem, which THP leaves alone by default
    buf = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = (ctypes.c_char * length).from_buffer(buf)
    offset = -ctypes.addressof(view) % HUGE_PAGE
    del view  # release the export (the tensor takes its own)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, offset, length - offset)
    except OSError as e:  # e.g. a kernel without THP
        logger.info("huge pages not available (%s); using the allocator's pages", e)
        buf.close()
        return None
    # unused head and tail pages of the mapping are never touched, so never backed
    out = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
    # fault every page in now, as torch.zeros would: a page first touched mid-run costs a
    # fault and a 2 MiB clear inside a step (measured: 13 % off offline throughput)
    out.zero_()
    return out


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed contiguous ``shape`` tensor of ``dtype`` on ``device``: on a CPU, when
    enabled and at least ``MIN_BYTES``, in its own mapping on huge pages; else
    ``torch.zeros``."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type == "cpu" and nbytes >= MIN_BYTES and enabled():
        raw = _mapped_bytes(nbytes)
        if raw is not None:
            return raw.view(dtype).view(shape)
    return torch.zeros(shape, dtype=dtype, device=device)


def huge_arena(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU ``tensors`` side by side in one mapping on huge pages (each at a
    64-byte boundary), for many tensors that are each too small for pages of their own;
    the tensors themselves when that does not apply (disabled, too little in all, another
    device). The copies keep the mapping alive."""
    if not tensors or not enabled() or any(t.device.type != "cpu" for t in tensors):
        return tensors
    sizes = [-(-t.nbytes // 64) * 64 for t in tensors]
    if sum(sizes) < MIN_BYTES:
        return tensors
    raw = _mapped_bytes(sum(sizes))
    if raw is None:
        return tensors
    out, at = [], 0
    for t, size in zip(tensors, sizes, strict=True):
        copy = raw[at : at + t.nbytes].view(t.dtype).view(t.shape)
        copy.copy_(t)
        out.append(copy)
        at += size
    return out
