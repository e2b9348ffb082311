"""The gpu_compute kernel table: one module per op family, each kernel written against ``xp``.

Importing this package registers every kernel. `kernel_class` finds the kernel of a layer;
`SUPPORTED_OPS` lists the op types that have one.
"""
from __future__ import annotations

from . import activations, conv, elementwise, linalg, movement, normalization, pool, reduce  # noqa: F401 (registration)
from .activations import apply_activations, can_fuse
from .base import FLOATS, PLAIN, Kernel, KernelContext, kernel_class, registered_op_types

#: Op types (default ONNX domain) with a gpu_compute kernel.
SUPPORTED_OPS: tuple[str, ...] = tuple(registered_op_types())

__all__ = ["FLOATS", "PLAIN", "SUPPORTED_OPS", "Kernel", "KernelContext", "apply_activations", "can_fuse",
           "kernel_class"]
