"""The pixel backend's kernel table: importing the families registers their kernels."""
from . import elementwise  # noqa: F401
from . import movement  # noqa: F401
from . import linalg, reduce  # noqa: F401
from .base import KERNELS, PixelKernel, pixel_kernel

__all__ = ["KERNELS", "PixelKernel", "pixel_kernel"]
