"""Concat that grows a buffer in place: ``present = Concat(past, new)`` without copying ``past``.

Two kinds of layer use it: a decoder's KV cache (below), and the chains of Concats that DenseNet
builds a dense block's features with (``Layer.grow_room``, `loader.optimize.mark_concat_chains`):
each layer's features are concatenated to everything before, so a plain Concat copies the whole
block's features again at every layer (DenseNet-121: 58 Concats, 1.1 ms of a 20 ms run on 2
cores). The chain's first Concat writes into a buffer with room for the whole chain, and each
later one appends its layer's features after the one before.

A decoder exported with past key/values concatenates each layer's cache with the step's new
keys and values, and returns the result as ``present``, which the caller feeds back as the next
step's ``past``. As a plain Concat that copies the whole cache every step: for GPT-2 with 8
streams, 24 caches of megabytes each, most of a step's non-GEMM time.

The optimizer marks such layers (`Layer.appends_cache`: a Concat whose first input is a graph
input and whose output a graph output, `loader.optimize.mark_cache_appends`). Their CPU kernel
writes its result into a buffer with room for `SPARE` more entries along the axis and returns a
view of it. When the next step's ``past`` is that view (or a view of it that ends where it
ends), the new entries are written into the room after it and the view is widened: nothing
else is copied. Anything else (a copy, a view that does not end at the buffer's high-water mark,
no room left, other shapes) is concatenated as usual, into a new buffer with room.

**Safe by construction:** entries are only ever written past the high-water mark of a buffer,
which no view handed out covers, and claiming the room is atomic; so every view keeps its
values, two runs fed the same ``past`` get correct results (the second copies), and a caller
that never feeds ``present`` back only pays for the unused room.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import numpy as np

#: Room left after the entries of a grown buffer (one decode step adds one entry per step).
SPARE = 32

_lock = threading.Lock()


class _Arena:
    """A buffer this module allocated, its data address, how far along the axis it is filled, and
    the last view of it handed out: (a weak reference to it, its ``start``, its ``end`` along the
    axis), one tuple so that a reader never sees one view's reference with another's window."""

    __slots__ = ("buffer", "address", "axis", "end", "last")

    def __init__(self, buffer: np.ndarray, axis: int, end: int):
        self.buffer = weakref.ref(buffer)
        self.address = buffer.__array_interface__["data"][0]
        self.axis = axis
        self.end = end
        self.last: tuple[weakref.ref[np.ndarray], int, int] | None = None

    def handed_out(self, view: np.ndarray, start: int, end: int) -> np.ndarray:
        """Remember ``view`` (``[start, end)`` along the axis) as the last view handed out; return it."""
        self.last = (weakref.ref(view), start, end)
        return view


# Buffers by id (an ndarray is not hashable); each entry goes with its buffer, and a lookup
# checks the weak reference, so a new array that reuses a dead one's id is never taken for it.
_arenas: dict[int, _Arena] = {}


def concat_growing(arrays: Sequence[np.ndarray], axis: int, room: int = SPARE) -> np.ndarray:
    """``np.concatenate(arrays, axis)``, appended in place after ``arrays[0]`` when it can be, else
    into a new buffer with ``room`` more entries along ``axis`` for the next append."""
    grown = _append_in_place(arrays, axis)
    return grown if grown is not None else _into_new_buffer(arrays, axis, room)


def _append_in_place(arrays: Sequence[np.ndarray], axis: int) -> np.ndarray | None:
    # On the hot path of every decode step (24 caches a step for GPT-2): one address read, the
    # common single appended array without generators.
    past = arrays[0]
    root = past.base
    if root is None:
        return None
    arena = _arenas.get(id(root))
    if arena is None or arena.buffer() is not root or arena.axis != axis:
        return None
    last = arena.last
    if last is not None and last[0]() is past:  # (a chain's next link: its window is known)
        start, end = last[1], last[2]
    else:
        window = _window(past, root, arena.address, axis)
        if window is None:
            return None
        start, end = window
    added = 0
    for a in arrays[1:]:  # np.concatenate says what is wrong (or promotes), not a silent broadcast here
        if (a.dtype != past.dtype or a.ndim != past.ndim or a.shape[:axis] != past.shape[:axis]
                or a.shape[axis + 1:] != past.shape[axis + 1:]):
            return None
        added += a.shape[axis]
    with _lock:  # claim the room: a second run fed the same past finds the mark moved and copies
        if arena.end != end or end + added > root.shape[axis]:
            return None
        arena.end = end + added
    index: list[slice] = [slice(None)] * root.ndim
    for a in arrays[1:]:
        index[axis] = slice(end, end + a.shape[axis])
        root[tuple(index)] = a
        end += a.shape[axis]
    index[axis] = slice(start, end)
    return arena.handed_out(root[tuple(index)], start, end)


def _window(view: np.ndarray, root: np.ndarray, root_address: int, axis: int) -> tuple[int, int] | None:
    """``(start, end)`` when ``view`` is ``root`` sliced along ``axis`` only, else None."""
    if view.dtype != root.dtype or view.strides != root.strides or view.ndim != root.ndim:
        return None
    if view.shape[:axis] != root.shape[:axis] or view.shape[axis + 1:] != root.shape[axis + 1:]:
        return None
    offset = view.__array_interface__["data"][0] - root_address
    step = root.strides[axis]
    if step <= 0 or offset % step:
        return None
    start = offset // step
    return start, start + view.shape[axis]


def _into_new_buffer(arrays: Sequence[np.ndarray], axis: int, room: int = SPARE) -> np.ndarray:
    first = arrays[0]
    expected = first.shape[:axis] + first.shape[axis + 1:]
    if any(a.ndim != first.ndim or a.shape[:axis] + a.shape[axis + 1:] != expected for a in arrays):
        return np.concatenate(arrays, axis=axis)  # raises, with NumPy's account of the mismatch
    shape = list(first.shape)
    filled = sum(a.shape[axis] for a in arrays)
    shape[axis] = filled + room
    root = np.empty(shape, dtype=np.result_type(*arrays))
    index: list[slice] = [slice(None)] * root.ndim
    index[axis] = slice(0, filled)
    view = root[tuple(index)]
    np.concatenate(arrays, axis=axis, out=view)
    return _register(root, axis, filled).handed_out(view, 0, filled)


def pad_growing(array: np.ndarray, pad: int, axis: int) -> np.ndarray:
    """``array`` after ``pad`` zeros along ``axis`` (``np.pad`` on that axis alone), written into a
    buffer with room for `SPARE` more entries: a `concat_growing` fed the result (or a view of it
    that ends where it ends) appends in place. The generation engine pads a cache so once every
    32 steps; with ``np.pad`` the step's ``Concat`` then copied it a second time, into a buffer
    with room."""
    shape = list(array.shape)
    filled = pad + shape[axis]
    shape[axis] = filled + SPARE
    root = np.empty(shape, dtype=array.dtype)
    index: list[slice] = [slice(None)] * root.ndim
    index[axis] = slice(0, pad)
    root[tuple(index)] = 0
    index[axis] = slice(pad, filled)
    root[tuple(index)] = array
    index[axis] = slice(0, filled)
    return _register(root, axis, filled).handed_out(root[tuple(index)], 0, filled)


def _register(root: np.ndarray, axis: int, filled: int) -> _Arena:
    """Make ``root`` (filled up to ``filled`` along ``axis``) a buffer `concat_growing` appends into."""
    key = id(root)
    arena = _Arena(root, axis, filled)
    with _lock:
        _arenas[key] = arena
    weakref.finalize(root, _forget, key, arena)
    return arena


def _forget(key: int, arena: _Arena) -> None:
    with _lock:
        if _arenas.get(key) is arena:
            del _arenas[key]
