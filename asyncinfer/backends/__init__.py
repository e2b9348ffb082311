"""Backends and the factory that builds one from a `BackendType`."""
from __future__ import annotations

import enum

from ..errors import BackendUnavailableError
from .base import Backend
from .cpu import CPUBackend


class BackendType(str, enum.Enum):
    """Where a worker runs its layers (Sentis's ``BackendType``)."""

    CPU = "cpu"
    GPU_COMPUTE = "gpu_compute"
    GPU_PIXEL = "gpu_pixel"


def parse_backend_type(backend: "BackendType | str") -> BackendType:
    try:
        return BackendType(backend.value if isinstance(backend, BackendType) else str(backend).lower())
    except ValueError:
        names = ", ".join(b.value for b in BackendType)
        raise BackendUnavailableError(f"unknown backend {backend!r}; choose one of {names}") from None


def create_backend(backend: "BackendType | str", *, threads: int | None = None) -> Backend:
    """Build the backend ``backend``; raises BackendUnavailableError saying what is missing."""
    kind = parse_backend_type(backend)
    if kind is BackendType.CPU:
        return CPUBackend(threads)
    if kind is BackendType.GPU_COMPUTE:
        return _build_gpu_compute()
    from .pixel import PixelBackend

    return PixelBackend()


def _build_gpu_compute() -> Backend:
    """The CuPy backend; BackendUnavailableError says what is missing (CuPy, a CUDA device, the driver)."""
    from .cupy import create_gpu_compute_backend  # imported here: CuPy itself is only imported if present

    return create_gpu_compute_backend()


__all__ = ["Backend", "BackendType", "CPUBackend", "create_backend", "parse_backend_type"]
