"""The gpu_compute backend: CUDA through CuPy (streams, events, pinned-memory readback).

``create_gpu_compute_backend()`` builds it, or raises BackendUnavailableError saying what is
missing (CuPy, a CUDA device, a working driver). Nothing here imports CuPy at import time, so the
package (its kernels run on NumPy too) imports on machines without CUDA.
"""
from __future__ import annotations

from ...errors import BackendUnavailableError
from .backend import CuPyBackend
from .device import cuda_unavailable_reason
from .hostdevice import HostRuntime
from .kernels import SUPPORTED_OPS
from .tensor import DeviceTensorData


def create_gpu_compute_backend(device_id: int = 0) -> CuPyBackend:
    """A CuPy backend on CUDA device ``device_id``; raises BackendUnavailableError saying what is missing."""
    reason = cuda_unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(reason)
    return CuPyBackend(device_id=device_id)


__all__ = ["SUPPORTED_OPS", "CuPyBackend", "DeviceTensorData", "HostRuntime", "create_gpu_compute_backend",
           "cuda_unavailable_reason"]
