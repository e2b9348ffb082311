"""Sequence and optional ops: SequenceConstruct/At/Insert/Erase/Length, SplitToSequence,
ConcatFromSequence, Optional/OptionalHasElement/OptionalGetElement, and ReverseSequence.

An ONNX sequence flows through the engine as a Python list of arrays and an empty optional as
``None``. Every op here builds a new list instead of editing its input one, since the same value
may be read by several layers (and threads) at once. Element arrays are shared, never copied:
values are immutable once produced.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .base import Op
from .registry import register
from .shape import int_list, normalize_axis, op_error

Array = np.ndarray
Seq = list  # an ONNX sequence value: a list of arrays


def _position(op: Op, position: Optional[Array], length: int, default: int, allow_end: bool) -> int:
    """A sequence index from a scalar ``position`` input, accepting negative values.

    ``allow_end`` admits ``length`` itself (inserting at the back); otherwise the accepted range
    is ``[-length, length - 1]``.
    """
    if position is None:
        return default
    values = int_list(position)
    if len(values) != 1:
        raise op_error(op, f"position must be a scalar, got {len(values)} values")
    pos = values[0]
    upper = length if allow_end else length - 1
    if not -length <= pos <= upper:
        raise op_error(op, f"position {pos} is out of range for a sequence of {length}")
    return pos + length if pos < 0 else pos


def _sequence(op: Op, value: Any) -> Seq:
    if not isinstance(value, list):
        raise op_error(op, f"expected a sequence, got {type(value).__name__}")
    return value


@register("SequenceConstruct", versions=(11,))
class SequenceConstruct(Op):
    def run(self, *tensors: Array) -> Seq:
        return list(tensors)


@register("SequenceEmpty", versions=(11,))
class SequenceEmpty(Op):
    def run(self) -> Seq:
        return []


@register("SequenceLength", versions=(11,))
class SequenceLength(Op):
    def run(self, sequence: Seq) -> Array:
        return np.array(len(_sequence(self, sequence)), dtype=np.int64)


@register("SequenceAt", versions=(11,))
class SequenceAt(Op):
    value_inputs = (1,)

    def run(self, sequence: Seq, position: Array) -> Array:
        sequence = _sequence(self, sequence)
        return sequence[_position(self, position, len(sequence), 0, allow_end=False)]


@register("SequenceInsert", versions=(11,))
class SequenceInsert(Op):
    value_inputs = (2,)

    def run(self, sequence: Seq, tensor: Array, position: Optional[Array] = None) -> Seq:
        sequence = _sequence(self, sequence)
        at = _position(self, position, len(sequence), len(sequence), allow_end=True)
        return sequence[:at] + [tensor] + sequence[at:]


@register("SequenceErase", versions=(11,))
class SequenceErase(Op):
    value_inputs = (1,)

    def run(self, sequence: Seq, position: Optional[Array] = None) -> Seq:
        sequence = _sequence(self, sequence)
        if not sequence:
            raise op_error(self, "cannot erase from an empty sequence")
        at = _position(self, position, len(sequence), len(sequence) - 1, allow_end=False)
        return sequence[:at] + sequence[at + 1:]


@register("SplitToSequence", versions=(11, 24))
class SplitToSequence(Op):
    value_inputs = (1,)

    def run(self, x: Array, split: Optional[Array] = None) -> Seq:
        axis = normalize_axis(self, self.attr("axis"), x.ndim)
        size = x.shape[axis]
        if split is None:  # pieces of one, the split axis kept or dropped per keepdims
            pieces = np.split(x, size, axis=axis) if size else []
            return pieces if self.attr("keepdims") else [np.squeeze(p, axis=axis) for p in pieces]
        lengths = int_list(split)
        if any(n < 0 for n in lengths):
            raise op_error(self, f"split lengths cannot be negative, got {lengths}")
        if np.ndim(split) == 0:  # chunks of that length, the last possibly shorter
            if lengths[0] == 0:
                raise op_error(self, "a chunk length of 0 never covers the axis")
            bounds = list(range(lengths[0], size, lengths[0]))
        else:
            if sum(lengths) != size:
                raise op_error(self, f"split lengths {lengths} do not add up to the axis size {size}")
            bounds = np.cumsum(lengths)[:-1].tolist()
        return np.split(x, bounds, axis=axis)


@register("ConcatFromSequence", versions=(11,))
class ConcatFromSequence(Op):
    def run(self, sequence: Seq) -> Array:
        sequence = _sequence(self, sequence)
        if not sequence:
            raise op_error(self, "cannot concatenate an empty sequence")
        rank = np.ndim(sequence[0])
        if self.attr("new_axis"):  # stack: the new axis may also go after the last one
            return np.stack(sequence, axis=normalize_axis(self, self.attr("axis"), rank + 1))
        return np.concatenate(sequence, axis=normalize_axis(self, self.attr("axis"), rank))


# -- optionals ------------------------------------------------------------------------------------
@register("Optional", versions=(15, 28))
class Optional_(Op):
    def run(self, value: Any = None) -> Any:
        return value  # an omitted input is the empty optional of the ``type`` attribute


@register("OptionalHasElement", versions=(15, 18, 28))
class OptionalHasElement(Op):
    def run(self, value: Any = None) -> Array:
        return np.array(value is not None)


@register("OptionalGetElement", versions=(15, 18, 28))
class OptionalGetElement(Op):
    def run(self, value: Any) -> Any:
        if value is None:
            raise op_error(self, "the optional input is empty")
        return value


# -- ReverseSequence ------------------------------------------------------------------------------
@register("ReverseSequence", versions=(10, 28))
class ReverseSequence(Op):
    def check(self) -> None:
        if {self.attr("batch_axis"), self.attr("time_axis")} != {0, 1}:
            self.unsupported(f"batch_axis={self.attr('batch_axis')}, time_axis={self.attr('time_axis')} "
                             "(must be 0 and 1)")

    def run(self, x: Array, sequence_lens: Array) -> Array:
        batch_axis, time_axis = self.attr("batch_axis"), self.attr("time_axis")
        if x.ndim < 2:
            raise op_error(self, f"input must have rank 2 or more, got {x.ndim}")
        lengths = int_list(sequence_lens)
        batch, time = x.shape[batch_axis], x.shape[time_axis]
        if len(lengths) != batch or any(not 0 <= n <= time for n in lengths):
            raise op_error(self, f"sequence_lens {lengths} do not fit batch {batch} and time {time}")
        # Per batch entry, the time index each output step reads: reversed below its length.
        t = np.arange(time)
        source = np.array([np.where(t < n, n - 1 - t, t) for n in lengths]).reshape(batch, time)
        index = source if batch_axis == 0 else source.T
        index = index.reshape(index.shape + (1,) * (x.ndim - 2))
        return np.take_along_axis(x, index, axis=time_axis)
