"""The GL thread: one thread owns the headless moderngl context and makes every GL call.

OpenGL contexts are bound to one thread, so everything that touches GL (uploads, draws,
downloads, freeing textures) is a closure put on this thread's queue. Between closures the
thread polls the GL sync fences of downloads in flight and completes their futures, so a
download never makes anybody wait: not the caller, not the event loop, not even this thread
(it polls with a zero timeout and keeps executing queued work).

moderngl has no fence object, so fences come from the GL library itself through ctypes:
``eglGetProcAddress`` returns ``glFenceSync``/``glClientWaitSync``/``glDeleteSync`` for the
context current on this thread (the one moderngl made), the same entry points moderngl's own
calls go through. They are only ever called on this thread.
"""
from __future__ import annotations

import ctypes
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from ...errors import BackendUnavailableError, DisposedError
from ...runtime.future import TaskFuture

GL_SYNC_GPU_COMMANDS_COMPLETE = 0x9117
GL_SYNC_FLUSH_COMMANDS_BIT = 0x00000001
GL_ALREADY_SIGNALED = 0x911A
GL_CONDITION_SATISFIED = 0x911C
GL_WAIT_FAILED = 0x911D

#: How often (seconds) the GL thread looks at its fences while nothing else is queued.
FENCE_POLL_INTERVAL = 0.0002

_STOP = object()
_log = logging.getLogger(__name__)


def create_context() -> Any:
    """A headless OpenGL ≥ 3.3 core context on EGL; BackendUnavailableError says what is missing."""
    try:
        import moderngl
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken native extension
        raise BackendUnavailableError(
            f"gpu_pixel needs moderngl and an EGL/OpenGL 3.3 context: moderngl cannot be imported ({exc}); "
            "install it with pip install 'asyncinfer[pixel]'") from None
    try:
        # Versioned sonames: the unversioned libEGL.so/libGL.so only exist with -dev packages.
        ctx = moderngl.create_context(standalone=True, backend="egl", libgl="libGL.so.1", libegl="libEGL.so.1")
    except Exception as exc:  # noqa: BLE001 - glcontext raises plain Exceptions with the EGL reason
        raise BackendUnavailableError(
            f"gpu_pixel needs an EGL display with OpenGL ≥ 3.3, and none could be created: {exc}. "
            "On Debian/Ubuntu install libegl1, libgl1 and libgl1-mesa-dri (Mesa's llvmpipe works "
            "without a GPU)") from None
    if ctx.version_code < 330:
        version = ctx.info.get("GL_VERSION", ctx.version_code)
        ctx.release()
        raise BackendUnavailableError(f"gpu_pixel needs OpenGL ≥ 3.3; this EGL context offers {version}")
    return ctx


class Fences:
    """GL sync objects, through the GL entry points EGL hands out for the current context."""

    def __init__(self) -> None:
        egl = ctypes.CDLL("libEGL.so.1")
        egl.eglGetProcAddress.restype = ctypes.c_void_p
        egl.eglGetProcAddress.argtypes = [ctypes.c_char_p]

        def proc(name: str, restype: Any, *argtypes: Any) -> Any:
            address = egl.eglGetProcAddress(name.encode())
            if not address:
                raise BackendUnavailableError(f"gpu_pixel: the GL library has no {name} (GL 3.2 sync objects)")
            return ctypes.CFUNCTYPE(restype, *argtypes)(address)

        self._fence = proc("glFenceSync", ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint)
        self._client_wait = proc("glClientWaitSync", ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint64)
        self._delete = proc("glDeleteSync", None, ctypes.c_void_p)

    def insert(self) -> int:
        """A fence after every GL command issued so far."""
        sync = self._fence(GL_SYNC_GPU_COMMANDS_COMPLETE, 0)
        if not sync:
            raise RuntimeError("glFenceSync returned no sync object")
        return sync

    def signaled(self, sync: int) -> bool:
        """Whether the commands before ``sync`` are done; never waits (zero timeout).

        The flush bit makes sure the fence itself reaches the GPU, or it might never signal.
        """
        status = self._client_wait(sync, GL_SYNC_FLUSH_COMMANDS_BIT, 0)
        if status == GL_WAIT_FAILED:
            raise RuntimeError("glClientWaitSync failed")
        return status in (GL_ALREADY_SIGNALED, GL_CONDITION_SATISFIED)

    def delete(self, sync: int) -> None:
        self._delete(sync)


class _Pending:
    """A fence and what to do once it signals."""

    __slots__ = ("sync", "complete", "future")

    def __init__(self, sync: int, complete: Callable[[], Any], future: TaskFuture):
        self.sync, self.complete, self.future = sync, complete, future


class GLThread:
    """Owns the context; runs queued closures in order; completes fenced futures."""

    def __init__(self, name: str = "asyncinfer-gl"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: list[_Pending] = []
        self._closed = False
        self._lock = threading.Lock()
        self.ctx: Any = None
        self.fences: Fences | None = None
        started: TaskFuture = TaskFuture(label="GL context")
        self._thread = threading.Thread(target=self._main, args=(started,), name=name, daemon=True)
        self._thread.start()
        started.result()  # raises BackendUnavailableError when there is no usable context

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    # -- submitting work -----------------------------------------------------------------------
    def submit(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` on the GL thread, after everything submitted before it."""
        with self._lock:  # nothing may be queued behind the stop marker: it would never run
            if self._closed:
                raise DisposedError("the gpu_pixel backend was closed")
            self._queue.put(fn)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the GL thread and wait for its result (worker creation only)."""
        if self.on_thread():
            return fn()
        future: TaskFuture = TaskFuture(label="GL call")

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

        self.submit(run)
        return future.result()

    def after_fence(self, complete: Callable[[], Any], future: TaskFuture) -> None:
        """(GL thread) Insert a fence now; once it signals, complete ``future`` with ``complete()``."""
        assert self.fences is not None
        self._pending.append(_Pending(self.fences.insert(), complete, future))

    # -- the thread ------------------------------------------------------------------------------
    def _main(self, started: TaskFuture) -> None:
        try:
            self.ctx = create_context()
            self.fences = Fences()
        except BaseException as exc:  # noqa: BLE001 - reported to the constructor
            started.set_exception(exc)
            return
        started.set_result(None)
        while True:
            try:
                fn = self._queue.get(timeout=FENCE_POLL_INTERVAL if self._pending else None)
            except queue.Empty:
                fn = None
            if fn is _STOP:
                break
            if fn is not None:
                try:
                    fn()
                except BaseException:  # noqa: BLE001 - closures fail their own futures; never kill the thread
                    _log.exception("uncaught error on the GL thread")
            if self._pending:
                self._poll_fences()
        self._shutdown()

    def _poll_fences(self) -> None:
        assert self.fences is not None
        still: list[_Pending] = []
        for pending in self._pending:
            try:
                if not self.fences.signaled(pending.sync):
                    still.append(pending)
                    continue
                self.fences.delete(pending.sync)
                value = pending.complete()
            except Exception as exc:  # noqa: BLE001 - a failed download fails its future
                pending.future.set_exception(exc)
                continue
            pending.future.set_result(value)
        self._pending = still

    def _shutdown(self) -> None:
        # Downloads in flight still deliver: wait for their fences (we are closing anyway).
        while self._pending:
            self._poll_fences()
        try:
            self.ctx.release()
        except Exception:  # noqa: BLE001 - closing a context that failed is not worth a traceback
            pass

    def close(self) -> None:
        """Run what is queued, deliver downloads in flight, release the context, join the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        if not self.on_thread():
            self._thread.join()
