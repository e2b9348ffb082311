"""The base class of the pixel backend's kernels, the kernel table, and shared GLSL helpers."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from ....model.ir import Layer
from ....ops.base import Op
from ...base import KERNELS

if TYPE_CHECKING:
    from ..device import PixelDevice
    from ..storage import PixelTensor

FLOAT32 = np.dtype(np.float32)
BOOL = np.dtype(bool)
INDEX_TYPES = (np.dtype(np.int32), np.dtype(np.int64))

BACKEND = "gpu_pixel"


def pixel_kernel(*op_types: str) -> Callable[[type["PixelKernel"]], type["PixelKernel"]]:
    """Register a kernel class for ``op_types`` in the kernel table (default domain, every opset
    the CPU op accepts)."""
    return KERNELS.register(BACKEND, op_types)  # type: ignore[return-value]


class PixelKernel:
    """Runs one layer as fragment-shader draws. Built once per layer when the worker is created.

    ``run`` is called on the GL thread with the layer's inputs: `PixelTensor` for data
    inputs, NumPy arrays for host inputs (the CPU op's ``value_inputs``, e.g. Reshape's shape),
    None for omitted optional inputs. It returns the output tensors, issuing draws, never waiting.

    Class attributes: ``index_inputs`` may hold integers or booleans (Gather's indices, Where's
    condition); every other data input must be float32. ``bool_output`` kernels produce booleans.
    ``fuses_activation`` kernels apply the layer's fused activations (``post``) in their last draw;
    for the others the backend runs them as one more draw.
    """

    index_inputs: ClassVar[frozenset[int]] = frozenset()
    bool_output: ClassVar[bool] = False
    fuses_activation: ClassVar[bool] = True

    def __init__(self, layer: Layer, op: Op):
        self.layer = layer
        self.op = op
        self.host_inputs = frozenset(op.value_inputs)

    def supports(self, types: Mapping[str, np.dtype | None]) -> bool:
        """Whether this layer (attributes and value types) can run here; the default checks types."""
        for i, name in enumerate(self.layer.inputs):
            if not name or i in self.host_inputs:
                continue
            dtype = types.get(name)
            allowed = (FLOAT32, BOOL, *INDEX_TYPES) if i in self.index_inputs else (FLOAT32,)
            if dtype is None or np.dtype(dtype) not in allowed:
                return False
        wanted = BOOL if self.bool_output else FLOAT32
        return all(types.get(o) is not None and np.dtype(types[o]) == wanted for o in self.layer.outputs if o)

    def prepare_constant(self, device: "PixelDevice", index: int, array: np.ndarray) -> "PixelTensor | None":
        """(GL thread) Upload constant input ``index`` in a layout of the kernel's choice; None: the
        natural layout."""
        return None

    def run(self, device: "PixelDevice", inputs: list, post: str | None) -> list["PixelTensor"]:
        raise NotImplementedError


# -- GLSL helpers shared by kernels -----------------------------------------------------------------
def strides(shape: tuple[int, ...]) -> list[int]:
    """C-order strides in elements."""
    result, step = [], 1
    for dim in reversed(shape):
        result.append(step)
        step *= dim
    return result[::-1]


def coordinate(i: str, shape: tuple[int, ...], axis: int) -> str:
    """GLSL expression: the coordinate on ``axis`` of flat index ``i`` in ``shape``."""
    stride = math.prod(shape[axis + 1:])
    expr = i if stride == 1 else f"({i} / {stride})"
    return expr if axis == 0 else f"({expr} % {shape[axis]})"


def broadcast_index(i: str, out_shape: tuple[int, ...], in_shape: tuple[int, ...]) -> str:
    """GLSL expression: the flat index into ``in_shape`` that NumPy broadcasting reads for output
    element ``i`` of ``out_shape``."""
    if tuple(in_shape) == tuple(out_shape):
        return i
    if math.prod(in_shape) == 1:
        return "0"
    offset = len(out_shape) - len(in_shape)
    in_strides = strides(tuple(in_shape))
    terms = []
    for axis, dim in enumerate(in_shape):
        if dim == 1:
            continue
        coord = coordinate(i, tuple(out_shape), axis + offset)
        terms.append(coord if in_strides[axis] == 1 else f"{coord} * {in_strides[axis]}")
    return " + ".join(terms) or "0"


def glsl_float(value: float) -> str:
    """GLSL of a host constant rounded to float32 (1e39 is inf, as on the CPU). Finite non-zero
    values are exact literals (``repr`` of the float32 value: denormals included). Zeros, infinities
    and NaN are ``opaque(bits)`` (shader.py): GLSL has no literal for inf or NaN, and the compiler
    folds a literal ``0.0 * x`` to 0 where the CPU gives NaN for an infinite or NaN x."""
    with np.errstate(over="ignore"):
        single = np.asarray(value, np.float64).astype(np.float32)
    if single != 0 and np.isfinite(single):
        return repr(float(single))
    return f"opaque(0x{int(single.view(np.uint32)):08x}u)"
