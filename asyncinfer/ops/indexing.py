"""Index-driven ops: Gather*, Scatter*, NonZero, TopK, Compress, Unique.

Indices are checked against the indexed dimension before use, so that an out-of-range index is
an ExecutionError naming the op rather than a bare NumPy IndexError (or, worse, a silent wrap).
"""
from __future__ import annotations

import numpy as np

from .base import Op
from .compiled.top_k import top_k_rows
from .registry import register
from .shape import Array, MaybeArray, normalize_axis, op_error


def normalize_indices(op: Op, indices: np.ndarray, dims: int | np.ndarray) -> np.ndarray:
    """int64 ``indices`` with negative values counted from the back of ``dims`` (broadcast)."""
    idx = np.asarray(indices).astype(np.int64, copy=False)
    if isinstance(dims, (int, np.integer)) and idx.size:  # one dimension: its extremes say all
        if idx.ndim == 0:  # one index (a pooler's first token): no reductions (3.0 -> 1.5 µs a Gather)
            lo = hi = int(idx)
        else:
            lo, hi = int(idx.min()), int(idx.max())  # (a Gather's indices: 8 µs of ufuncs -> 2)
        if 0 <= lo and hi < dims:
            return idx
    dims = np.asarray(dims, dtype=np.int64)
    bad = (idx < -dims) | (idx >= dims)
    if bad.any():
        raise op_error(op, f"index {int(idx[bad][0])} is out of range for dimension(s) {dims.tolist()}")
    return np.where(idx < 0, idx + dims, idx)


def _element_coords(op: Op, data: np.ndarray, indices: np.ndarray, axis: int) -> tuple[np.ndarray, ...]:
    """Coordinates into ``data`` of every element of ``indices`` for GatherElements/ScatterElements."""
    indices = np.asarray(indices)
    if indices.ndim != data.ndim:
        raise op_error(op, f"indices of rank {indices.ndim} for data of rank {data.ndim}")
    coords = list(np.indices(indices.shape, sparse=True))
    coords[axis] = normalize_indices(op, indices, data.shape[axis])
    return tuple(coords)


@register("Gather", versions=(1, 11, 13))
class Gather(Op):
    def run(self, data: Array, indices: Array) -> Array:
        data = np.asarray(data)
        axis = normalize_axis(self, self.attr("axis"), data.ndim)
        return np.take(data, normalize_indices(self, indices, data.shape[axis]), axis=axis)


@register("GatherElements", versions=(11, 13))
class GatherElements(Op):
    def run(self, data: Array, indices: Array) -> Array:
        data = np.asarray(data)
        axis = normalize_axis(self, self.attr("axis"), data.ndim)
        return data[_element_coords(self, data, indices, axis)]


@register("GatherND", versions=(11, 12, 13))
class GatherND(Op):
    def run(self, data: Array, indices: Array) -> Array:
        data, indices = np.asarray(data), np.asarray(indices)
        b = self.attr("batch_dims", 0)
        k = indices.shape[-1] if indices.ndim else 0
        if indices.ndim < 1 or data.shape[:b] != indices.shape[:b] or b + k > data.ndim:
            raise op_error(self, f"indices {indices.shape} do not fit data {data.shape} with batch_dims={b}")
        # Flatten the batch dims and the index tuples: data[batch, i0, …, ik-1] for every (batch, tuple).
        batches, tuples = int(np.prod(data.shape[:b])), int(np.prod(indices.shape[b:-1]))
        idx = normalize_indices(self, indices.reshape(batches, tuples, k), np.array(data.shape[b:b + k]))
        flat = data.reshape((batches,) + data.shape[b:])
        batch_idx = np.broadcast_to(np.arange(batches)[:, None], (batches, tuples))
        out = flat[(batch_idx,) + tuple(idx[..., j] for j in range(k))]
        return out.reshape(indices.shape[:-1] + data.shape[b + k:])


# ufunc applied by each Scatter reduction, and the first opset of ScatterElements/ND having it.
_REDUCTIONS = {"none": (None, 11), "add": (np.add, 16), "mul": (np.multiply, 16),
               "max": (np.maximum, 18), "min": (np.minimum, 18)}


class _Scatter(Op):
    """Shared reduction handling of ScatterElements and ScatterND (inputs are copied, not mutated)."""

    def check(self) -> None:
        reduction = self.attr("reduction", "none")
        if reduction not in _REDUCTIONS or self.version < _REDUCTIONS[reduction][1]:
            self.unsupported(f"attribute reduction={reduction!r}")

    def _scatter(self, data: np.ndarray, coords: tuple[np.ndarray, ...], updates: np.ndarray) -> np.ndarray:
        out = np.array(data, copy=True)
        expected = np.broadcast_shapes(*(np.shape(c) for c in coords)) + out.shape[len(coords):]
        if np.shape(updates) != expected:
            raise op_error(self, f"updates have shape {np.shape(updates)}, expected {expected}")
        ufunc = _REDUCTIONS[self.attr("reduction", "none")][0]
        if ufunc is None:
            out[coords] = updates
        else:  # ufunc.at accumulates over duplicate indices, unlike fancy assignment
            ufunc.at(out, coords, updates)
        return out


@register("ScatterElements", versions=(11, 13, 16, 18))
class ScatterElements(_Scatter):
    def run(self, data: Array, indices: Array, updates: Array) -> Array:
        data = np.asarray(data)
        axis = normalize_axis(self, self.attr("axis"), data.ndim)
        return self._scatter(data, _element_coords(self, data, indices, axis), np.asarray(updates))


@register("ScatterND", versions=(11, 13, 16, 18))
class ScatterND(_Scatter):
    def run(self, data: Array, indices: Array, updates: Array) -> Array:
        data, indices = np.asarray(data), np.asarray(indices)
        k = indices.shape[-1] if indices.ndim else 0
        if indices.ndim < 1 or k > data.ndim:
            raise op_error(self, f"indices {indices.shape} do not fit data {data.shape}")
        idx = normalize_indices(self, indices, np.array(data.shape[:k]))
        return self._scatter(data, tuple(idx[..., j] for j in range(k)), np.asarray(updates))


@register("NonZero", versions=(9, 13))
class NonZero(Op):
    def run(self, x: Array) -> Array:
        x = np.atleast_1d(np.asarray(x))  # a scalar is treated as a 1-element vector
        return np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)


@register("TopK", versions=(1, 10, 11, 24))
class TopK(Op):
    value_inputs = (1,)

    def check(self) -> None:
        if self.version < 10:  # k was an attribute in TopK-1
            self.attr("k")

    def run(self, x: Array, k: MaybeArray = None) -> tuple[Array, Array]:
        x = np.asarray(x)
        k = self.attr("k") if self.version < 10 else int(np.asarray(k).reshape(-1)[0])
        axis = normalize_axis(self, self.attr("axis"), x.ndim)
        n = x.shape[axis]
        if not 0 <= k <= n:
            raise op_error(self, f"k={k} is out of range for a dimension of size {n}")
        largest = bool(self.attr("largest", 1))
        top = _selected(x, k, axis, largest)
        if top is None:
            # always sorted, which "sorted=0" allows
            top = np.take(_stable_order(x, axis, largest), np.arange(k), axis=axis)
        return np.take_along_axis(x, top, axis=axis), top.astype(np.int64, copy=False)


def _stable_order(x: np.ndarray, axis: int, largest: bool) -> np.ndarray:
    """The positions along ``axis`` in TopK's order: by value, descending where ``largest``, ties
    by ascending index (a NaN counts as the largest value, as NumPy's sort places it)."""
    if largest:
        # stable ascending sort of the reversed axis, read backwards (negating would break
        # unsigned types)
        return x.shape[axis] - 1 - np.flip(np.argsort(np.flip(x, axis), axis=axis, kind="stable"), axis)
    return np.argsort(x, axis=axis, kind="stable")


def _selected(x: np.ndarray, k: int, axis: int, largest: bool) -> np.ndarray | None:
    """TopK's ``k`` positions along ``axis``, in order, by the compiled heap selection
    (`compiled.top_k`); None for a dtype it does not take (then the full sort is the way).
    Narrow floats select on their float32 values (the same order, NaN included)."""
    if x.dtype.kind == "f" and x.dtype.itemsize < 4:
        x = x.astype(np.float32)
    if x.dtype.kind not in "fiu" or k == 0 or x.size == 0:
        return None
    along = np.moveaxis(x, axis, -1) if axis != x.ndim - 1 else x  # (each NumPy call costs µs in a run)
    rows = np.ascontiguousarray(along).reshape(-1, x.shape[axis])
    top = np.empty(along.shape[:-1] + (k,), np.int64)
    top_k_rows(rows, k, largest, top.reshape(-1, k), np.empty(k, rows.dtype))
    return np.moveaxis(top, -1, axis) if axis != x.ndim - 1 else top


@register("Compress", versions=(9, 11, 28))
class Compress(Op):
    def run(self, data: Array, condition: Array) -> Array:
        data = np.asarray(data)
        axis = self.attr("axis", None)
        if axis is None:
            data, axis = data.reshape(-1), 0
        axis = normalize_axis(self, axis, data.ndim)
        condition = np.asarray(condition).astype(bool, copy=False).reshape(-1)
        if condition.size > data.shape[axis]:
            raise op_error(self, f"condition longer ({condition.size}) than the axis ({data.shape[axis]})")
        return np.compress(condition, data, axis=axis)


@register("Unique", versions=(11, 28))
class Unique(Op):
    def run(self, x: Array) -> tuple[Array, Array, Array, Array]:
        x = np.asarray(x)
        axis = self.attr("axis", None)
        if axis is not None:
            axis = normalize_axis(self, axis, x.ndim)
        y, first, inverse, counts = np.unique(x, return_index=True, return_inverse=True,
                                              return_counts=True, axis=axis)
        inverse = inverse.reshape(-1)
        if not self.attr("sorted"):  # reorder by first occurrence
            order = np.argsort(first, kind="stable")
            rank = np.empty_like(order)
            rank[order] = np.arange(order.size)
            y, first, counts = np.take(y, order, axis=axis or 0), first[order], counts[order]
            inverse = rank[inverse]
        return y, first.astype(np.int64), inverse.astype(np.int64), counts.astype(np.int64)
