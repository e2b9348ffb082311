"""What kernels use on the GL thread: uploads, draws and fenced downloads of `PixelTensor`s."""
from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...concurrency.future import TaskFuture
from .gl import GLThread
from .layout import Layout, natural_layout
from .shader import ProgramCache, fragment_source
from .storage import PixelTensor, TexturePool, gl_errors

#: Integers a float32 texel holds exactly.
EXACT_INT_LIMIT = 1 << 24
#: Loop iterations llvmpipe runs in one fragment, all loops together: past it, it leaves them
#: silently (gallivm's LP_MAX_TGSI_LOOP_ITERATIONS, a guard against endless shaders).
LLVMPIPE_LOOP_LIMIT = 65535


class PixelDevice:
    """The GL context with its texture pool and program cache. Methods marked (GL thread) must
    run there; the rest may be called from any thread."""

    def __init__(self) -> None:
        self.gl = gl = GLThread()
        try:
            self.pool: TexturePool = gl.call(lambda: TexturePool(gl.ctx))
            self.programs: ProgramCache = gl.call(lambda: ProgramCache(gl.ctx))
            self.max_texture_size: int = gl.call(lambda: int(gl.ctx.info["GL_MAX_TEXTURE_SIZE"]))
            self.renderer: str = gl.call(lambda: str(gl.ctx.info["GL_RENDERER"]))
        except BaseException:
            gl.close()
            raise
        self.draws = 0
        #: Loop iterations one fragment may run (None: no known limit).
        self.loop_limit: int | None = LLVMPIPE_LOOP_LIMIT if "llvmpipe" in self.renderer else None
        # A device nobody closed (its worker dropped without dispose) still ends its GL thread
        # once unreachable; the callback must not hold the device itself.
        self._finalizer = weakref.finalize(self, _close_soon, gl, self.pool, self.programs)
        self._finalizer.atexit = False

    # -- storage (GL thread) ------------------------------------------------------------------------
    def texture_size(self, layout: Layout) -> tuple[int, int]:
        return layout.texture_size(self.max_texture_size)

    def empty(self, shape: tuple[int, ...], dtype: Any = np.float32, layout: Layout | None = None,
              tag: str = "") -> PixelTensor:
        """(GL thread) A tensor whose texels a draw will write."""
        layout = layout or natural_layout(tuple(shape))
        surface = self.pool.take(self.texture_size(layout))
        return PixelTensor(self, surface, tuple(shape), np.dtype(dtype), layout, tag=tag)

    def upload(self, array: np.ndarray, layout: Layout | None = None, tag: str = "",
               shape: tuple[int, ...] | None = None) -> PixelTensor:
        """(GL thread) Copy a host array into a new texture (``layout`` defaults to the natural one)."""
        array = np.asarray(array)
        if array.dtype.kind in "iu" and array.size and int(np.abs(array).max()) >= EXACT_INT_LIMIT:
            raise ValueError(f"integer values beyond ±2^24 cannot be stored exactly in a float texture "
                             f"(largest here: {int(np.abs(array).max())})")
        if array.dtype.kind not in "fiub":
            raise ValueError(f"the gpu_pixel backend stores numbers and booleans, not {array.dtype}")
        shape = tuple(array.shape) if shape is None else shape
        tensor = self.empty(shape, array.dtype, layout or natural_layout(shape), tag=tag)
        width, height = tensor.surface.size
        tensor.surface.texture.write(tensor.layout.pack(array, width, height))
        return tensor

    # -- drawing (GL thread) ----------------------------------------------------------------------------
    def draw(self, out_shape: tuple[int, ...], body: str, inputs: Mapping[str, PixelTensor], *,
             mode: str = "value", layout: Layout | None = None, dtype: Any = np.float32,
             post: str | None = None) -> PixelTensor:
        """(GL thread) Run one fragment shader over a new output tensor (see shader.py for ``body``)."""
        out = self.empty(tuple(out_shape), dtype, layout)
        width = out.surface.size[0]
        declared = [(name, t.layout, t.surface.size[0]) for name, t in inputs.items()]
        program, vao = self.programs.get(fragment_source(declared, out.layout, width, body, mode, post))
        for unit, (name, tensor) in enumerate(inputs.items()):
            tensor.surface.texture.use(location=unit)
            try:
                program[name].value = unit
            except KeyError:  # the compiler dropped a sampler this body does not read
                pass
        out.surface.framebuffer.use()
        vao.render(vertices=3)
        self.draws += 1
        return out

    def check_errors(self) -> None:
        """(GL thread) Raise the pending GL errors, if any, as a RuntimeError (clearing them all, so
        that none is left to fail a later step)."""
        errors = gl_errors(self.gl.ctx)
        if errors:
            raise RuntimeError(f"OpenGL reported {', '.join(errors)}")

    def clear_errors(self) -> None:
        """(GL thread) Drop the pending GL errors of a step that failed anyway."""
        gl_errors(self.gl.ctx)

    # -- downloads (any thread) --------------------------------------------------------------------------
    def start_download(self, tensor: PixelTensor) -> TaskFuture:
        """Copy ``tensor`` to the host without waiting: a pixel-pack-buffer read and a fence are
        queued on the GL thread; the future completes (with a NumPy array) when the fence signals."""
        future = TaskFuture(label="gpu_pixel download")

        def read() -> None:
            buffer = None
            try:
                width, height = tensor.surface.size
                buffer = self.gl.ctx.buffer(reserve=width * height * 16)
                errors = gl_errors(self.gl.ctx)  # an unallocated buffer comes back with a GL error
                if errors:
                    raise MemoryError(f"gpu_pixel could not allocate a {width * height * 16 / 2**20:.0f} MiB "
                                      f"download buffer: OpenGL reported {', '.join(errors)}")
                tensor.surface.framebuffer.read_into(buffer, components=4, dtype="f4")
            except Exception as exc:  # noqa: BLE001 - reported through the future
                if buffer is not None:
                    buffer.release()
                gl_errors(self.gl.ctx)
                future.set_exception(exc)
                return

            def finish() -> np.ndarray:
                try:
                    image = np.frombuffer(buffer.read(), np.float32)
                finally:
                    buffer.release()
                return _to_dtype(tensor.layout.unpack(image, tensor.shape), tensor.dtype)

            self.gl.after_fence(finish, future)

        try:
            self.gl.submit(read)
        except Exception as exc:  # noqa: BLE001 - closed backend
            future.set_exception(exc)
        return future

    def close(self) -> None:
        self._finalizer.detach()

        def release() -> None:
            self.pool.release_all()
            self.programs.release_all()

        try:
            self.gl.call(release)
        finally:
            self.gl.close()


def _close_soon(gl: GLThread, pool: TexturePool, programs: ProgramCache) -> None:
    """Release the textures and programs, then end the GL thread, from the GL thread itself: a
    finalizer may run on any thread (this one included) and must not wait."""
    def close() -> None:
        pool.release_all()
        programs.release_all()
        gl.close()  # on its own thread: marks the end without joining

    try:
        gl.submit(close)
    except Exception:  # noqa: BLE001 - already closed
        pass


def _to_dtype(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if dtype.kind == "b":
        return values != 0
    if dtype.kind in "iu":
        return np.rint(values).astype(dtype)
    return values.astype(dtype, copy=False)
