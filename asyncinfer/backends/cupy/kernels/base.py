"""What every gpu_compute kernel shares: the kernel class, its context, the registry, dtype rules.

Kernels are written against the array API of a module ``xp`` (``cupy`` on the GPU, ``numpy`` in CI)
so their logic runs and is tested without a GPU. A kernel is built once per layer, when the
worker is created, and runs on the backend's dispatcher thread only: it may keep per-layer caches
without locks. It reads its attributes through the CPU op of the layer (``self.op``), so both
backends parse attributes, defaults and opset differences the same way.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import numpy as np

from ....model.ir import Layer
from ....ops.base import Op
from ...base import KERNELS, ValueTypes

F32, F16 = np.dtype(np.float32), np.dtype(np.float16)
#: Element types the math kernels compute on (anything else falls back to the CPU).
FLOATS = frozenset({F32, F16})
#: Element types that kernels which only move data (or test/select) may carry as well.
PLAIN = FLOATS | frozenset(np.dtype(t) for t in (np.int32, np.int64, np.bool_))


@dataclass(frozen=True)
class KernelContext:
    """The device a kernel runs on, as seen by kernel code.

    ``xp`` is the array module; ``to_device`` copies a small host array to the device (enqueued
    on the stream, never waited for); ``erf`` is the device error function; ``conv`` is an
    optional accelerated convolution (cuDNN) taking ``(x, w, pads, strides, dilations, group)``,
    or None to use the im2col kernel; ``fuse`` optionally runs ``activations(x + b)`` as one
    kernel (``fuse(x, b, activations, out)``, None when it cannot), see `..fusion`.
    """

    xp: ModuleType
    to_device: Callable[[np.ndarray], Any]
    erf: Callable[[Any], Any]
    conv: Callable[..., Any] | None = None
    fuse: Callable[..., Any] | None = None

    def as_strided(self, x: Any, shape: tuple[int, ...], strides: tuple[int, ...]) -> Any:
        """A strided view of ``x`` (both NumPy and CuPy provide ``lib.stride_tricks.as_strided``)."""
        return self.xp.lib.stride_tricks.as_strided(x, shape=shape, strides=strides)

    def work(self, x: Any) -> Any:
        """``x`` in the precision math is done in: float16 is computed in float32, like the CPU ops do."""
        return x.astype(self.xp.float32) if x.dtype == F16 else x


class Kernel:
    """A device kernel for one layer. Subclasses set ``op_types`` and implement `run`.

    Class attributes:

    - ``op_types``: the ONNX op types it implements (default domain only);
    - ``fresh_output``: output 0 is a new buffer, so fused activations may overwrite it in place;
    - ``takes_activations``: ``run`` takes the layer's fused activations (keyword ``activations``)
      and applies them itself, so they can share a kernel with its last step (bias, addition);
    - ``host_inputs``: input indices the kernel reads on the host besides the CPU op's
      ``value_inputs`` (e.g. Gather's indices, checked on the host like the CPU does);
    - ``dtypes``: element types accepted for the device inputs and the outputs.
    """

    op_types: ClassVar[tuple[str, ...]] = ()
    fresh_output: ClassVar[bool] = True
    takes_activations: ClassVar[bool] = False
    host_inputs: ClassVar[frozenset[int]] = frozenset()
    dtypes: ClassVar[frozenset[np.dtype]] = FLOATS

    def __init__(self, layer: Layer, op: Op):
        self.layer = layer
        self.op = op

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        """Whether this kernel can run ``layer``: by default every device input and every output
        has a known type in ``dtypes``. ``host`` are the input indices read on the host."""
        device_inputs = [n for i, n in enumerate(layer.inputs) if n and i not in host]
        return all_typed(types, device_inputs + [o for o in layer.outputs if o], cls.dtypes)

    def run(self, ctx: KernelContext, *inputs: Any, **options: Any) -> Any:
        """Enqueue the layer's work; returns its output (or a tuple of outputs). Must not synchronise."""
        raise NotImplementedError

    def __call__(self, ctx: KernelContext, *inputs: Any, **options: Any) -> tuple:
        out = self.run(ctx, *inputs, **options)
        return out if isinstance(out, tuple) else (out,)


def all_typed(types: ValueTypes, names: Iterable[str], allowed: Iterable[np.dtype]) -> bool:
    """True when every value in ``names`` has a known element type among ``allowed``."""
    allowed = frozenset(allowed)
    for name in names:
        dtype = types.get(name)
        if dtype is None or np.dtype(dtype) not in allowed:
            return False
    return True


def same_type(types: ValueTypes, names: Iterable[str]) -> bool:
    """True when every (non-empty) value in ``names`` has the same known element type."""
    found = {None if types.get(n) is None else np.dtype(types[n]) for n in names if n}
    return len(found) == 1 and None not in found


BACKEND = "gpu_compute"


def register(cls: type[Kernel]) -> type[Kernel]:
    """Class decorator: make ``cls`` the gpu_compute kernel of each of its ``op_types`` in the
    kernel table (default domain, every version the CPU op implements)."""
    return KERNELS.register(BACKEND, cls.op_types)(cls)


def kernel_class(layer: Layer) -> type[Kernel] | None:
    """The kernel class for ``layer`` in the kernel table, or None."""
    return KERNELS.lookup(BACKEND, layer)


def registered_op_types() -> list[str]:
    """Every op type with a device kernel, sorted."""
    return [op_type for _, op_type in KERNELS.op_types(BACKEND)]


def channel_shape(x: Any, m: int) -> tuple[int, ...]:
    """Shape that broadcasts a per-channel vector of length ``m`` over an (N, C, ...) tensor."""
    return (m,) + (1,) * (x.ndim - 2)


def scalar(x: Any, value: float) -> Any:
    """``value`` as a scalar of ``x``'s dtype (keeps float16/float32 math from promoting)."""
    return np.dtype(x.dtype).type(value)
