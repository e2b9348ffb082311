"""The pixel backend's kernel table: importing the families registers their kernels."""
from . import conv, elementwise, linalg, movement, pool, reduce  # noqa: F401
from .base import BACKEND, PixelKernel, pixel_kernel

__all__ = ["BACKEND", "PixelKernel", "pixel_kernel"]
