"""Allocator tuning for the CPU backend.

Every layer allocates its outputs. With glibc's defaults, blocks over a (dynamic) threshold come
straight from ``mmap`` and go back with ``munmap``, so each run touches fresh pages and pays a
page fault per 4 KiB on first write: on a ResNet-50 that is more time than all its additions and
activations take. Raising the mmap threshold keeps large blocks in the heap, where the next run
reuses them warm. It is process-wide, so it can be turned off with ASYNCINFER_MALLOC_TUNING=0.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

_lock = threading.Lock()
_done = False
_libc: "ctypes.CDLL | None" = None


def tune_allocator() -> bool:
    """Apply the tuning once per process on glibc; True if it is in effect."""
    global _done
    with _lock:
        if _done:
            return True
        if os.environ.get("ASYNCINFER_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
            return False
        libc = _glibc()
        if libc is None:  # not glibc (musl, …): nothing to tune
            return False
        mallopt = libc.mallopt
        ok = bool(mallopt(_M_MMAP_THRESHOLD, 1 << 30))     # blocks up to 1 GiB stay in the heap
        ok &= bool(mallopt(_M_TRIM_THRESHOLD, 1 << 31))    # and freed ones are kept for reuse
        ok &= bool(mallopt(_M_TOP_PAD, 64 << 20))          # grow the heap in 64 MiB steps
        _done = ok
        return ok


def release_free_memory() -> None:
    """Give the heap's free memory back to the system (glibc's ``malloc_trim``).

    The tuning above keeps freed blocks for the next run; when a worker is disposed there is no
    next run, so its blocks, in every thread's arena, are returned instead of staying resident.
    """
    if not _done:
        return
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _glibc() -> "ctypes.CDLL | None":
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            return None
        _libc = libc
    return _libc
