"""The device runtime: the small interface the backend drives, and its CUDA implementation.

Everything that touches CUDA directly is here (and in `.cudnn`): selecting the device,
the stream, events, pinned host buffers for uploads and readbacks. Every method is called on the
backend's dispatcher thread only, which owns the device and the stream (CuPy's current device and
stream are per thread). `HostRuntime` implements the same interface on NumPy,
so the backend's machinery runs in CI without a GPU.
"""
from __future__ import annotations

from collections import deque
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from .kernels.base import KernelContext

# The message every gpu_compute "not available" error starts with.
NEEDS = "gpu_compute needs CuPy and a CUDA device"
INSTALL_HINT = "pip install 'asyncinfer[gpu]'"


class Readback(Protocol):
    """A device-to-host copy in flight. ``done()`` polls its event; ``result()`` (once done) is
    a caller-owned NumPy copy of the value."""

    def done(self) -> bool: ...

    def result(self) -> np.ndarray: ...


class DeviceRuntime(Protocol):
    """What the backend needs from a device. Called on the dispatcher thread only."""

    xp: ModuleType
    description: str

    def start(self) -> KernelContext:
        """Make the device and a stream current on this thread; the kernels' context."""

    def to_device(self, host: np.ndarray) -> Any:
        """A device copy of ``host``, enqueued on the stream (the caller may reuse ``host`` at once)."""

    def start_readback(self, array: Any) -> Readback:
        """Enqueue a copy of ``array`` into pinned host memory plus an event; never waits."""

    def poll(self) -> None:
        """Release staging buffers whose copies have completed."""

    def stop(self) -> None:
        """Wait for the stream to drain and release what the runtime holds."""


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA runtime cannot start here (None: CuPy imports and a device is visible).

    The message says what is missing: CuPy itself, or the driver's own error text.
    """
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken CUDA install raising on import
        detail = "" if isinstance(exc, ModuleNotFoundError) else f": {type(exc).__name__}: {exc}"
        return f"{NEEDS}: CuPy is not installed ({INSTALL_HINT}){detail}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError: no driver, insufficient driver...
        return f"{NEEDS}: no usable CUDA device ({type(exc).__name__}: {exc})"
    if count < 1:
        return f"{NEEDS}: no CUDA device is visible (cudaGetDeviceCount returned 0)"
    return None


class _CudaReadback:
    """A D2H copy into pinned memory on the stream, with the event recorded after it."""

    __slots__ = ("_event", "_pinned", "_source")

    def __init__(self, event: Any, pinned: np.ndarray, source: Any):
        self._event = event
        self._pinned = pinned
        self._source = source  # keeps the device buffer out of the pool until the copy is done

    def done(self) -> bool:
        return self._event is None or self._event.done  # cudaEventQuery: never blocks

    def result(self) -> np.ndarray:
        out = np.array(self._pinned, copy=True)  # the pinned block goes back to its pool
        self._pinned = self._source = None
        return out


class CudaRuntime:
    """CuPy on one CUDA device, with one non-blocking stream and CuPy's memory pools.

    Uploads are staged through pinned buffers (so they are truly asynchronous), which are kept
    until their copy's event completes; readbacks copy into pinned buffers and record an event.
    Device buffers come from CuPy's (stream-ordered) memory pool: a tensor's buffer is reused as
    soon as its last reference is dropped, which is safe because every kernel runs on the one stream.
    Convolutions use cuDNN when CuPy has it (``use_cudnn``); a layer's bias or addition and its
    fused activations run as one generated kernel (``fuse_epilogues``, see `.fusion`).
    """

    def __init__(self, device_id: int = 0, *, use_cudnn: bool = True, fuse_epilogues: bool = True):
        import cupy  # raises ImportError where CuPy is missing: the caller reports it

        self.xp: ModuleType = cupy
        self.device_id = device_id
        self.use_cudnn = use_cudnn
        self.fuse_epilogues = fuse_epilogues
        self.description = f"CUDA device {device_id}"
        self._stream: Any = None
        self._staging: deque[tuple[Any, np.ndarray]] = deque()

    def start(self) -> KernelContext:
        import cupy
        import cupyx
        import cupyx.scipy.special

        from .cudnn import cudnn_convolution
        from .fusion import FusedEpilogue

        self._cupyx = cupyx
        device = cupy.cuda.Device(self.device_id)
        device.use()
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self._stream.use()  # current for this (the dispatcher) thread: every kernel goes on it
        name = cupy.cuda.runtime.getDeviceProperties(self.device_id)["name"]
        self.description = f"{name.decode() if isinstance(name, bytes) else name} (device {self.device_id})"
        conv = cudnn_convolution() if self.use_cudnn else None
        fuse = FusedEpilogue(cupy) if self.fuse_epilogues else None
        return KernelContext(xp=cupy, to_device=self.to_device, erf=cupyx.scipy.special.erf, conv=conv, fuse=fuse)

    def _record(self) -> Any:
        event = self.xp.cuda.Event(block=False, disable_timing=True)
        event.record(self._stream)
        return event

    def to_device(self, host: np.ndarray) -> Any:
        host = np.ascontiguousarray(host)
        out = self.xp.empty(host.shape, dtype=host.dtype)
        if host.nbytes:
            staging = self._cupyx.empty_pinned(host.shape, dtype=host.dtype)
            staging[...] = host
            out.set(staging, stream=self._stream)
            self._staging.append((self._record(), staging))
        return out

    def start_readback(self, array: Any) -> _CudaReadback:
        array = self.xp.ascontiguousarray(array)
        if array.size == 0:  # nothing to copy (and no zero-byte pinned block to ask for)
            return _CudaReadback(None, np.empty(array.shape, dtype=array.dtype), None)
        pinned = self._cupyx.empty_pinned(array.shape, dtype=array.dtype)
        array.get(stream=self._stream, out=pinned, blocking=False)
        return _CudaReadback(self._record(), pinned, array)

    def poll(self) -> None:
        while self._staging and self._staging[0][0].done:  # events complete in stream order
            self._staging.popleft()

    def stop(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        self._staging.clear()

    def memory_stats(self) -> tuple[int, int]:
        """``(bytes handed out, bytes held)`` by CuPy's device memory pool (tests, diagnostics)."""
        pool = self.xp.get_default_memory_pool()
        return int(pool.used_bytes()), int(pool.total_bytes())
