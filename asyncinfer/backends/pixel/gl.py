"""The GL thread: one thread owns the headless moderngl context and makes every GL call.

OpenGL contexts are bound to one thread, so everything that touches GL (uploads, draws,
downloads, freeing textures) is a closure put on this thread's queue (a
`DeviceThread`). Between closures the thread polls the
GL sync fences of downloads in flight and completes their futures, so a download never makes
anybody wait: not the caller, not the event loop, not even this thread (it polls with a zero
timeout and keeps executing queued work).

moderngl has no fence object, so fences come from the GL library itself through ctypes:
``eglGetProcAddress`` returns ``glFenceSync``/``glClientWaitSync``/``glDeleteSync`` for the
context current on this thread (the one moderngl made), the same entry points moderngl's own
calls go through. They are only ever called on this thread.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from ...errors import BackendUnavailableError, DisposedError
from ...concurrency.future import TaskFuture
from ...concurrency.device_thread import DeviceThread

GL_SYNC_GPU_COMMANDS_COMPLETE = 0x9117
GL_SYNC_FLUSH_COMMANDS_BIT = 0x00000001
GL_ALREADY_SIGNALED = 0x911A
GL_CONDITION_SATISFIED = 0x911C
GL_WAIT_FAILED = 0x911D



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


class GLThread(DeviceThread):
    """Owns the context: runs queued closures in order and completes fenced futures."""

    def __init__(self, name: str = "asyncinfer-gl"):
        self.ctx: Any = None
        self.fences: Fences | None = None
        super().__init__(name)  # raises BackendUnavailableError when there is no usable context

    def start_device(self) -> None:
        self.ctx = create_context()
        self.fences = Fences()

    def stop_device(self) -> None:
        try:
            self.ctx.release()
        except Exception:  # noqa: BLE001 - closing a context that failed is not worth a traceback
            pass
        release_egl_thread()


    def submit(self, fn: Callable[[], Any]) -> bool:
        """Run ``fn()`` on the GL thread, after everything submitted before it."""
        if not super().submit(_Once(fn)):
            raise self.closed_error()
        return True

    def closed_error(self) -> BaseException:
        return DisposedError("the gpu_pixel backend was closed")

    def after_fence(self, complete: Callable[[], Any], future: TaskFuture) -> None:
        """(GL thread) Insert a fence now; once it signals, complete ``future`` with ``complete()``."""
        fences = self.fences
        assert fences is not None
        sync = fences.insert()
        failure: list[BaseException] = []

        def signaled() -> bool:
            try:
                return fences.signaled(sync)
            except Exception as exc:  # noqa: BLE001 - a failed wait fails the download
                failure.append(exc)
                return True

        def finish() -> None:
            fences.delete(sync)
            if failure:
                future.set_exception(failure[0])
                return
            try:
                value = complete()
            except Exception as exc:  # noqa: BLE001 - a failed download fails its future
                future.set_exception(exc)
                return
            future.set_result(value)

        self.watch(signaled, finish)


class _Once:
    """A job that lets go of its closure once run. The thread's loop holds the last job it ran
    until the next one comes: a closure over the device would keep an idle, forgotten backend
    alive, and its thread with it (see PixelDevice's finalizer)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], Any]):
        self.fn: Callable[[], Any] | None = fn

    def __call__(self) -> Any:
        fn, self.fn = self.fn, None
        return fn() if fn is not None else None


def release_egl_thread() -> None:
    """Free EGL's per-thread state before the GL thread ends (``eglReleaseThread``): without it
    Mesa keeps a few MiB per thread that ever made a context current, so creating and disposing
    gpu_pixel workers would grow the process without bound."""
    try:
        ctypes.CDLL("libEGL.so.1").eglReleaseThread()
    except (OSError, AttributeError):  # no EGL library: no context was ever made either
        pass
