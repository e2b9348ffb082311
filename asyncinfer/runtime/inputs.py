"""Binding and checking a run's inputs against the model's declared (symbolic) signature.

Everything here happens before any work is scheduled, so a bad input never leaves a half-run.
The checks are ONNX Runtime's, so that every input it accepts is accepted here: the element type,
the rank where the shape is declared, and every fixed size (0 included). A named dimension
(``batch``) or an unknown one (None: no size, a negative size, or a placeholder name such as
``?`` or ``unk__3``, see ``model.onnx_import``) takes any size. An overridable initializer (an
input with a default, ``Model.input_defaults``) may be left out: the run uses its default.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import InputError
from ..limits import Limits
from ..model.ir import Model, TensorInfo
from ..tensor import Tensor
from ..concurrency.future import TaskFuture
from ..concurrency.holding_gil import copy_array


class InputShapeWarning(UserWarning):
    """Inputs that ONNX Runtime accepts but that look inconsistent with the model's declared shapes
    (one dimension name given different sizes)."""


def example_inputs(model: Model) -> dict[str, np.ndarray]:
    """Zeros of every input's declared type and shape (a symbolic or unknown dimension is 1): inputs
    that pass the checks of `bind_inputs`, for a warm-up run.

    Raises:
        InputError: an input whose example cannot be made up (a sequence or map, or a tensor of
            undeclared rank): the caller must give example inputs.
    """
    examples = {}
    for info in model.inputs:
        if info.name in model.input_defaults:  # an overridable initializer: its own value
            examples[info.name] = model.input_defaults[info.name]
            continue
        if info.kind != "tensor":
            raise InputError(f"input {info.name!r} is a {info.kind}: give example inputs to warm this model up")
        if info.shape is None:
            raise InputError(f"input {info.name!r} declares no shape (not even its rank): give example inputs "
                             f"to warm this model up, e.g. worker.warmup({{{info.name!r}: array}})")
        shape = tuple(d if isinstance(d, int) and d >= 0 else 1 for d in (info.shape or ()))
        dtype = np.dtype(np.float32) if info.dtype is None else np.dtype(info.dtype)
        examples[info.name] = np.full(shape, "", dtype) if dtype.kind in "OUS" else np.zeros(shape, dtype)
    return examples


def bind_inputs(model: Model, args: Sequence[Any], kwargs: Mapping[str, Any],
                borrow: bool = False) -> dict[str, TaskFuture]:
    """Map ``schedule(...)`` arguments to input futures; raises InputError naming the input at fault.

    Each array is copied (the caller may reuse its buffer while the run is pending), unless
    ``borrow``: a run the caller waits for (``run``, ``run_blocking``) reads a C-contiguous,
    writeable NumPy array of the input's type in place, as ONNX Runtime's ``run`` does (no kernel
    writes into its inputs): a 224x224 image's copy took 60-70 µs of a MobileNetV3 run, a batch of 32
    about a millisecond."""
    declared = {i.name: i for i in model.inputs}
    if len(args) == 1 and not kwargs and type(args[0]) is dict:  # (the common case: no ABC check, no copy)
        given = args[0]
    elif len(args) == 1 and isinstance(args[0], Mapping) and not kwargs:
        given = dict(args[0])
    else:
        if len(args) > len(model.inputs):
            raise InputError(f"{len(args)} positional inputs given, the model takes {len(model.inputs)}: "
                             f"{[i.name for i in model.inputs]}")
        given = {info.name: value for info, value in zip(model.inputs, args)}
        for name, value in kwargs.items():
            if name in given:
                raise InputError(f"input {name!r} given both positionally and by name")
            given[name] = value
    extra = [] if given.keys() == declared.keys() else [n for n in given if n not in declared]
    if extra:
        fixed = [n for n in extra if n in model.constant_initializers]
        why = (f" ({', '.join(map(repr, fixed))}: an initializer of the model, a constant; a caller may override "
               "an initializer only where the model also lists it among its graph inputs, IR version 4 or later)"
               ) if fixed else ""
        raise InputError(f"unknown input(s) {extra}; the model's inputs are {list(declared)}{why}")
    defaults = model.input_defaults
    missing = [] if len(given) == len(declared) else [n for n in declared if n not in given and n not in defaults]
    if missing:
        raise InputError(f"missing input(s) {missing}; the model's inputs are {list(declared)}")

    bindings: dict[str, tuple[int, str, int]] = {}
    futures: dict[str, TaskFuture] = {}
    for name, info in declared.items():
        if name in given:  # an overridable initializer fed by the caller is checked as any input
            futures[name] = _input_future(info, given[name], bindings, model.limits, borrow)
        else:  # read-only, shared by the runs that do not override it
            futures[name] = TaskFuture.completed([defaults[name]], label=name)
    return futures


def _input_future(info: TensorInfo, value: Any, bindings: dict[str, tuple[int, str, int]],
                  limits: Limits, borrow: bool = False) -> TaskFuture:
    if isinstance(value, Tensor):
        if value.disposed:
            raise InputError(f"input {info.name!r}: the tensor was disposed")
        if value.is_pending:  # chained from another run: dtype checked now, shape when it arrives
            _check_dtype(info, value.dtype)
            return _chained(value)
        value = value.numpy()
    if info.kind != "tensor":  # a sequence or optional input: checked for its kind, passed as is
        return TaskFuture.completed([_sequence_or_optional(info, value)], label=info.name)
    try:
        if isinstance(value, np.ndarray):
            array = value
        elif info.dtype is not None and not isinstance(value, np.generic):
            array = np.asarray(value, dtype=info.dtype)  # Python lists/scalars take the declared type
        else:
            array = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise InputError(f"input {info.name!r}: cannot make an array of {type(value).__name__}: {exc}") from None
    if array.ndim > limits.max_tensor_rank or array.size > limits.max_tensor_elements:  # (the message: only then)
        limits.check_shape(array.shape, f"input {info.name!r} of shape {array.shape}")
    # big-endian data ('>f4') is the same type, stored swapped
    native = array.dtype if array.dtype.isnative else array.dtype.newbyteorder("=")
    if native != info.dtype:
        _check_dtype(info, native)
    _check_shape(info, array.shape, bindings)
    if borrow and type(array) is np.ndarray and array.dtype == native:
        flags = array.flags  # (a new object each time it is asked for)
        if flags.c_contiguous and flags.writeable:  # (a read-only one, a request body's view, say, would
            return TaskFuture.completed([array], label=info.name)  # make compiled kernels compile again)
    # A private copy in native byte order: the caller may reuse its buffer while the run is pending
    # (made keeping the GIL: on an event loop's thread, see concurrency/holding_gil.py).
    return TaskFuture.completed([copy_array(array, native)], label=info.name)


def _sequence_or_optional(info: TensorInfo, value: Any) -> Any:
    if value is None and info.kind == "optional":
        return None
    if info.kind in ("sequence", "optional") and isinstance(value, (list, tuple)):
        return [np.array(v, copy=True) for v in value]
    if info.kind == "optional" and isinstance(value, (np.ndarray, Tensor)):
        return np.array(value, copy=True)
    raise InputError(f"input {info.name!r} is a {info.kind}; got {type(value).__name__}")


def _chained(tensor: Tensor) -> TaskFuture:
    """A host copy of a pending tensor from another run, as soon as its readback completes.

    The forwarding runs on whichever thread completes the readback (perhaps a device thread), so
    it must not wait: it reads the already-downloaded value.
    """
    fut = TaskFuture(label=tensor.name)
    readback = tensor._readback_future()

    def forward(done: TaskFuture) -> None:
        try:
            fut.set_result([tensor._storage_now(done).download()])
        except Exception as exc:  # noqa: BLE001 - the upstream failure flows into this run
            fut.set_exception(exc)

    readback.add_done_callback(forward)
    return fut


def _check_dtype(info: TensorInfo, dtype: np.dtype | None) -> None:
    if info.dtype is not None and dtype is not None and np.dtype(dtype) != info.dtype:
        raise InputError(f"input {info.name!r} must be {info.dtype.name}, got {np.dtype(dtype).name} "
                         f"(convert with .astype(np.{info.dtype.name}))")


def _check_shape(info: TensorInfo, shape: tuple[int, ...], bindings: dict[str, tuple[int, str, int]]) -> None:
    """Rank and fixed sizes must match, as ONNX Runtime requires; a named dimension takes any size.

    A name seen with two sizes (``batch`` 2 on one input, 3 on another) is accepted with a warning,
    as ONNX Runtime accepts it: where the graph truly needs them equal, the layer that combines them
    fails with an ExecutionError naming it. ``bindings`` maps each name to its first (size, input,
    axis) in this run.
    """
    if info.shape is None or shape == info.shape:  # (every dimension fixed, and as declared)
        return
    if len(shape) != len(info.shape):
        raise InputError(f"input {info.name!r} must have rank {len(info.shape)} {_declared(info)}, "
                         f"got shape {tuple(shape)}")
    for axis, (dim, size) in enumerate(zip(info.shape, shape)):
        if isinstance(dim, int) and dim != size:
            raise InputError(f"input {info.name!r} must have shape {_declared(info)}, got {tuple(shape)} "
                             f"(axis {axis} is {size}, expected {dim})")
        if isinstance(dim, str) and dim:
            first = bindings.setdefault(dim, (size, info.name, axis))
            if first[0] != size:
                # No sizes in the text: warnings are shown once per distinct message, and requests are untrusted.
                warnings.warn(f"input {info.name!r} axis {axis} and input {first[1]!r} axis {first[2]} share the "
                              f"dimension name {dim!r} but were given different sizes; running anyway, as ONNX "
                              "Runtime does", InputShapeWarning)


def _declared(info: TensorInfo) -> str:
    """The declared shape as errors show it: ``(N, 3, 224, 224)``, ``?`` for a dimension left open."""
    return "(" + ", ".join("?" if d is None else str(d) for d in info.shape or ()) + ")"
