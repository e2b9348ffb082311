"""The ``gpu_pixel`` backend: fragment shaders on a headless moderngl (EGL) context."""
from .backend import PixelBackend

__all__ = ["PixelBackend"]
