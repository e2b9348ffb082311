"""Handing a finished run's output arrays to its caller without copying them.

A run's outputs are copied for the caller, so that nothing the caller does to them reaches a
value the worker still holds: a constant, a cached shape, an input, another output sharing its
memory. A `Worker.run` or `run_blocking` (`Execution.private`) hands the caller nothing else, and
most of its outputs are arrays a kernel has just made and nobody else holds: copying those is
pure cost (BERT-tiny's 64 KB output took 27 µs of its 2 ms run, 5 µs handed over; GPT-2's 3.2 MB
of keys and values are strided views into its cache's buffer, and are still copied, to the C
order a caller expects). `sole_array` says when an output is such an
array, by counting the references to it (and to the array that owns its memory, for a view):
any holder besides the run's own list of the step's values (a cache, a constant, an input,
another output, a layer still reading it) makes the count higher and the output is copied.
"""
from __future__ import annotations

import sys

import numpy as np


def _references(values: list, index: int) -> int:
    """References to ``values[index]`` at this call (the list's own included)."""
    return sys.getrefcount(values[index])


def _base_references(array: np.ndarray) -> int:
    """References to the array that owns ``array``'s memory (``array``'s own included)."""
    return sys.getrefcount(array.base)


def _calibrate() -> tuple[int, int]:
    """The counts of an array that a list alone holds, and of an owner that a view alone holds,
    taken through the same calls as the checks' (the interpreter's own temporaries vary across
    Python versions)."""
    held = [np.empty(1)]
    view = [np.empty(2)[1:]]
    return _references(held, 0), _base_references(view[0])


_SOLE, _SOLE_OWNER = _calibrate()


def sole_array(values: list, index: int) -> bool:
    """Whether ``values[index]`` is a C-contiguous, writeable NumPy array that nothing but
    ``values`` holds, whose memory is its own or that of an array nothing but it holds: the
    caller may take it as is. The caller must hold no other reference to it while asking."""
    if _references(values, index) != _SOLE:
        return False
    array = values[index]
    if type(array) is not np.ndarray or not array.flags.c_contiguous or not array.flags.writeable:
        return False
    if array.base is None:
        return True
    # (no local name for the owner: it would be one more reference to it)
    return type(array.base) is np.ndarray and array.base.base is None and _base_references(array) == _SOLE_OWNER
