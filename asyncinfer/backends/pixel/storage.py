"""Device tensors of the pixel backend, and the pool that recycles their textures."""
from __future__ import annotations

import queue
from typing import Any, Protocol

import numpy as np

from ...errors import AsyncInferError
from ...tensor import TensorData
from .layout import Layout



def gl_errors(ctx: Any) -> list[str]:
    """(GL thread) Every pending GL error flag, clearing them (GL keeps one per kind)."""
    errors = []
    for _ in range(8):  # bounded: a lost context may report GL_CONTEXT_LOST forever
        error = ctx.error
        if error == "GL_NO_ERROR":
            break
        errors.append(error)
    return errors


class Surface:
    """An RGBA32F texture with the framebuffer that draws into it (pooled together)."""

    __slots__ = ("texture", "framebuffer", "size")

    def __init__(self, ctx: Any, size: tuple[int, int]):
        import moderngl

        self.size = size
        self.texture = ctx.texture(size, 4, dtype="f4")
        # A texture GL cannot allocate (GL_OUT_OF_MEMORY) still comes back, with an error flag:
        # checked here, or the flag fails some later, unrelated step.
        errors = gl_errors(ctx)
        if errors:
            self.texture.release()
            gl_errors(ctx)
            raise MemoryError(f"gpu_pixel could not allocate a {size[0]}×{size[1]} RGBA32F texture "
                              f"({size[0] * size[1] * 16 / 2**20:.0f} MiB): OpenGL reported {', '.join(errors)}")
        self.texture.filter = (moderngl.NEAREST, moderngl.NEAREST)
        try:
            self.framebuffer = ctx.framebuffer(color_attachments=[self.texture])
        except Exception:
            self.texture.release()
            gl_errors(ctx)
            raise

    def release(self) -> None:
        self.framebuffer.release()
        self.texture.release()


class TexturePool:
    """Surfaces by size. Freed ones come back from any thread (a tensor dropped anywhere) through
    a thread-safe queue; the GL thread takes them in before it allocates.

    Reusing a surface right after its last reader was *issued* is safe: GL runs one context's
    commands in order, so the reads happen before the next writes."""

    def __init__(self, ctx: Any):
        self._ctx = ctx
        self._free: dict[tuple[int, int], list[Surface]] = {}
        self._returned: queue.SimpleQueue = queue.SimpleQueue()
        self.allocated = 0
        self.reused = 0
        self.closed = False

    def give_back(self, surface: Surface) -> None:
        """Return a surface (any thread)."""
        if not self.closed:
            self._returned.put(surface)

    def take(self, size: tuple[int, int]) -> Surface:
        """(GL thread) A surface of ``size``, recycled when one is free."""
        self._collect()
        free = self._free.get(size)
        if free:
            self.reused += 1
            return free.pop()
        try:
            surface = Surface(self._ctx, size)
        except MemoryError:
            if not any(self._free.values()):
                raise
            self._release_free()  # the pooled textures of other sizes may be what is missing
            surface = Surface(self._ctx, size)
        self.allocated += 1
        return surface

    def _collect(self) -> None:
        while True:
            try:
                surface = self._returned.get_nowait()
            except queue.Empty:
                return
            self._free.setdefault(surface.size, []).append(surface)

    def release_all(self) -> None:
        """(GL thread) Free every pooled texture; surfaces still held are freed with the context."""
        self._collect()
        self.closed = True
        self._release_free()

    def _release_free(self) -> None:
        """(GL thread) Free the pooled surfaces nobody holds."""
        for surfaces in self._free.values():
            for surface in surfaces:
                surface.release()
        self._free.clear()


class _Device(Protocol):
    """What a tensor needs of the device holding it (the PixelDevice, which builds tensors)."""

    gl: Any
    pool: TexturePool

    def start_download(self, tensor: "PixelTensor") -> Any: ...


class PixelTensor(TensorData):
    """A tensor stored in a texture: ``shape``, logical ``dtype`` and the `Layout`.

    Values are float32 in the texture. Integer and boolean tensors are stored exactly as floats
    (uploads refuse integers beyond ±2²⁴) and get their dtype back when downloaded.
    ``tag`` marks constants a kernel packed in its own arrangement (e.g. convolution weights).
    When the last reference goes, the texture returns to the pool.
    """

    backend = "gpu_pixel"
    __slots__ = ("shape", "dtype", "layout", "surface", "tag", "_device", "_owner")

    def __init__(self, device: _Device, surface: Surface, shape: tuple[int, ...], dtype: np.dtype,
                 layout: Layout, tag: str = "", owner: "PixelTensor | None" = None):
        self._device = device
        self.surface = surface
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.layout = layout
        self.tag = tag
        self._owner = owner  # a view (reshape) keeps the tensor owning the texture alive

    @property
    def size(self) -> int:
        return self.layout.size

    def view(self, shape: tuple[int, ...], dtype: np.dtype | None = None) -> "PixelTensor":
        """The same texels under another shape with as many elements (a free reshape)."""
        return PixelTensor(self._device, self.surface, shape, self.dtype if dtype is None else dtype,
                           self.layout, owner=self._owner or self)

    def download(self) -> np.ndarray:
        """Blocking: copy the value to the host. Use ``Tensor.readback_request`` to not wait."""
        if self._device.gl.on_thread():
            raise AsyncInferError("a blocking download was called on the GL thread (from a completion "
                                  "callback outside an event loop?): use readback_request() instead")
        return self._device.start_download(self).result()

    def __del__(self) -> None:
        if self._owner is None:
            try:
                self._device.pool.give_back(self.surface)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    def __repr__(self) -> str:
        return f"<PixelTensor {self.dtype.name}{list(self.shape)} {self.layout}>"
