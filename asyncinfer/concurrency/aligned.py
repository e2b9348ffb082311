"""Scratch buffers aligned to a cache line.

The register-blocked kernels (`ops/compiled/panels.py`, `depthwise_block.py`) load and store
whole vectors of 64 bytes (AVX-512) or 32. NumPy aligns its data to 16 bytes only, so a vector
of a scratch buffer used to straddle two cache lines more often than not, and each such access
costs two: the depthwise loop's sums took 20-30% longer from a buffer 16 bytes off a line than
from one on it (1152 channels, 7x7 map, 5x5 kernel: 80 against 60 µs).
"""
from __future__ import annotations

import numpy as np

#: Bytes of a cache line, the widest vector too.
LINE = 64


def aligned_bytes(nbytes: int) -> np.ndarray:
    """A fresh uint8 array of ``nbytes`` whose data starts on a `LINE` boundary (a view of a
    slightly larger block, which it keeps alive)."""
    block = np.empty(nbytes + LINE, np.uint8)
    start = -block.ctypes.data % LINE
    return block[start:start + nbytes]
