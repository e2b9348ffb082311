"""External tensor data memory-mapped from the model's files, and its pages handed back.

A large external tensor is a read-only view of a mapping of its file: nothing is copied at load,
and its pages count in the process's memory only once a kernel reads them. A kernel that keeps a
form of its own (weights packed in panels) reads the original once, to make that form; its pages
are then handed back (`release_resident_pages`), so the model's weights are resident once, not
twice, as ONNX Runtime frees an initializer it has prepacked. A mapping is read-only and backed
by the file, so a later read of the original still sees the same bytes (the kernel faults them
in again from the page cache).
"""
from __future__ import annotations

import mmap
from typing import Any, BinaryIO

import numpy as np

# External tensors from this size on are memory-mapped rather than read (see map_or_read).
MMAP_MIN_BYTES = 1 << 20


def map_or_read(f: BinaryIO, offset: int, length: int) -> Any:
    """``length`` bytes of ``f`` from ``offset``: a read-only memory map for large tensors (the
    page cache is shared with the file, nothing is copied until a kernel derives a new array, as
    ONNX Runtime does), a plain read for small ones (a mapping per tiny tensor costs more)."""
    if length < MMAP_MIN_BYTES:
        f.seek(offset)
        return f.read(length)
    start = offset - offset % mmap.ALLOCATIONGRANULARITY  # a mapping starts on a granule
    mapped = mmap.mmap(f.fileno(), length + (offset - start), access=mmap.ACCESS_READ, offset=start)
    return memoryview(mapped)[offset - start:]


def _mapping_of(array: np.ndarray) -> mmap.mmap | None:
    """The read-only file mapping ``array``'s memory lies in (through views and memoryviews), or
    None (an array of its own, a mapping made elsewhere)."""
    base: Any = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    if isinstance(base, mmap.mmap) and not base.closed:
        return base
    return None


def is_mapped(array: np.ndarray) -> bool:
    """Whether ``array`` is a view of a file mapping (`map_or_read`): pages the process can hand
    back, where a copy of it would be anonymous memory held for good."""
    return _mapping_of(array) is not None


def release_resident_pages(array: np.ndarray) -> int:
    """Hand back to the page cache the pages wholly inside ``array`` when it is a view of a
    read-only file mapping (`map_or_read`); the bytes handed back (0 for any other array, or
    where the platform has no ``MADV_DONTNEED``). ``array`` stays valid: a later read faults its
    pages in again, with the same bytes."""
    mapping = _mapping_of(array)
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if mapping is None or advice is None or array.nbytes == 0:
        return 0
    origin = np.frombuffer(mapping, dtype=np.uint8).ctypes.data  # read-only: frombuffer, not ctypes
    low = array.ctypes.data - origin
    high = low + array.nbytes
    if not array.flags.c_contiguous or low < 0 or high > len(mapping):
        return 0  # only a contiguous block we can place inside the mapping
    page = mmap.PAGESIZE
    first, end = -(-low // page) * page, high // page * page
    if end <= first:
        return 0
    mapping.madvise(advice, first, end - first)
    return end - first
