"""A NumPy stand-in for `CudaRuntime`: the same interface, on host memory.

It lets the whole gpu_compute machinery (dispatcher thread, uploads, kernels, fallback, downloads,
every readback mode) run where there is no GPU, as in CI. Its "events" can be held by a test so
that readbacks stay pending, proving that completion comes from the event and nothing else; and it
records which threads made device calls, proving they all come from the dispatcher thread.
"""
from __future__ import annotations

import threading
import numpy as np

from ...ops.elementwise import erf as host_erf
from .kernels.base import KernelContext


class _HostReadback:
    """A finished copy whose event reports done unless the runtime is holding events."""

    def __init__(self, runtime: "HostRuntime", copy: np.ndarray):
        self._runtime = runtime
        self._copy = copy

    def done(self) -> bool:
        self._runtime.queries += 1
        self._runtime._note_call()
        return not self._runtime.holding

    def result(self) -> np.ndarray:
        return self._copy


class HostRuntime:
    """The device runtime on NumPy: uploads and readbacks are copies, events are instant
    unless held (``hold_events`` / ``release_events``)."""

    xp = np
    description = "NumPy host stand-in (no GPU)"

    def __init__(self) -> None:
        self.holding = False
        self.queries = 0  # event queries made (polls)
        self.uploads = 0
        self.readbacks = 0
        self.threads: set[int] = set()  # idents of the threads that made device calls
        self.started = False
        self.stopped = False
        self.upload_gate: threading.Event | None = None  # when set by a test, uploads wait for it

    def _note_call(self) -> None:
        self.threads.add(threading.get_ident())

    def hold_events(self) -> None:
        """Keep every readback pending (their events report not done) until released."""
        self.holding = True

    def release_events(self) -> None:
        self.holding = False

    def start(self) -> KernelContext:
        self._note_call()
        self.started = True
        return KernelContext(xp=np, to_device=self.to_device, erf=_erf)

    def to_device(self, host: np.ndarray) -> np.ndarray:
        self._note_call()
        if self.upload_gate is not None and not self.upload_gate.wait(30):
            raise TimeoutError("upload gate never opened")
        self.uploads += 1
        return np.array(host, copy=True, order="C")  # device memory is never the caller's buffer

    def start_readback(self, array: np.ndarray) -> _HostReadback:
        self._note_call()
        self.readbacks += 1
        return _HostReadback(self, np.array(array, copy=True, order="C"))

    def poll(self) -> None:
        self._note_call()

    def stop(self) -> None:
        self._note_call()
        self.stopped = True


def _erf(x: np.ndarray) -> np.ndarray:
    """erf in ``x``'s float type (the host helper may compute in float64)."""
    return np.asarray(host_erf(x)).astype(x.dtype, copy=False)
