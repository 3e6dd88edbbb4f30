"""Make a process's resident set follow its tensors: freed memory goes back to the OS, so the peak is the tensors'.

[Note: glibc's moving mmap threshold] A CPU tensor's bytes come from glibc's ``malloc``. Blocks above the *mmap
threshold* get pages of their own, returned to the OS by ``free``; smaller ones come from a heap (an *arena*, one
per thread that allocates), whose freed holes stay resident until something of their size fills them. The threshold
starts at 128 KiB and *moves*: each time a block that had its own pages is freed, it rises to that block's size (up
to 32 MiB). A sharded step frees a gathered unit or a bucket's gradient every few milliseconds, so after the first
one every later one of that size lands in a heap instead, the holes are kept, and gloo's threads each keep their own
arena of them: a ZeRO-3 rank measured its peak resident set more than twice the tensors it ever held at once.
Setting the threshold (``mallopt(M_MMAP_THRESHOLD)``) pins it, and every large block is returned when freed. The
cost is a page fault per page of each large allocation, small beside the collectives that move those bytes.

``MALLOC_MMAP_THRESHOLD_`` in the environment (glibc's own tunable) wins: then nothing here changes it.
"""

from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20  # blocks from 1 MiB up get their own pages; smaller ones cannot fragment much


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to pin
        return None


def return_freed_memory_to_the_os(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Pin glibc's mmap threshold at ``threshold`` and trim the heap; False where that is not possible (or wanted)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    ok = bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
    trim()
    return ok


def trim() -> None:
    """Give the heaps' free pages back (``malloc_trim``): after a phase that freed much, e.g. building the model."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
