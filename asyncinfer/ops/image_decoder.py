"""ImageDecoder (opset 20): an encoded image (a 1-D uint8 tensor) to an (H, W, C) uint8 tensor.

Decoding is Pillow's, an optional dependency (``pip install 'asyncinfer[image]'``): without it a
model holding an ImageDecoder is refused at load with an UnsupportedOperatorError saying so.

The encoded bytes are untrusted. Only the formats the spec lists are opened (BMP, JPEG, JPEG 2000,
TIFF, PNG, WebP and the portable anymaps PBM/PGM/PPM/PNM), never the other formats Pillow can read
(some hand the data to outside programs). The header's size is checked against
``Limits.max_image_pixels`` and ``max_tensor_elements`` before any pixel is decoded (a
"decompression bomb": a few bytes that decode to gigabytes). A stream that cannot be decoded
(corrupt, truncated, another format) is an ExecutionError naming the layer; the spec lets an
implementation return an empty tensor instead, which would only fail later and less clearly.

``pixel_format`` RGB gives (H, W, 3), BGR the same with the channels reversed, Grayscale (H, W, 1)
with Pillow's ITU-R 601-2 luma, as onnx.reference does. Images with alpha, a palette or CMYK are
converted to RGB (alpha dropped); 16-bit grey samples keep their 8 high bits; 32-bit integer or
float samples are an error. Multi-frame files
(TIFF, WebP) give their first frame.
"""
from __future__ import annotations

import io
from typing import Any

import numpy as np

from .base import Op
from .registry import register
from .shape import check_mode, op_error

#: Pillow's names of the formats the spec lists ("PPM" reads PBM, PGM, PPM and PNM).
FORMATS = ("BMP", "JPEG", "JPEG2000", "TIFF", "PNG", "WEBP", "PPM")
_CHANNELS = {"RGB": 3, "BGR": 3, "Grayscale": 1}
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")


def pillow() -> Any:
    """``PIL.Image`` (Pillow), or None when it is not installed."""
    try:
        from PIL import Image  # noqa: PLC0415  (optional dependency, imported when a model needs it)
    except ImportError:
        return None
    return Image


@register("ImageDecoder", versions=(20,))
class ImageDecoder(Op):
    """Decode one JPEG/PNG/BMP/TIFF/WebP/JPEG 2000/PNM image into (H, W, C) uint8 (see the module)."""

    def check(self) -> None:
        check_mode(self, "pixel_format", "RGB", tuple(_CHANNELS))
        self.image = pillow()
        if self.image is None:
            self.unsupported("decoding images without Pillow: install the optional dependency with "
                             "pip install 'asyncinfer[image]'")

    def run(self, encoded: np.ndarray) -> np.ndarray:
        encoded = np.asarray(encoded)
        if encoded.dtype != np.uint8 or encoded.ndim != 1:
            raise op_error(self, f"the encoded stream must be a 1-D uint8 tensor, got {encoded.dtype} "
                                 f"of shape {encoded.shape}")
        fmt = self.attr("pixel_format")
        try:  # reads the header only
            img = self.image.open(io.BytesIO(encoded.tobytes()), formats=FORMATS)
        except Exception as exc:  # noqa: BLE001 - Pillow raises OSError, SyntaxError, ValueError… on bad data
            raise self._undecodable(encoded, exc) from None
        with img:
            width, height = img.size
            if width * height > self.limits.max_image_pixels:
                raise op_error(self, f"the image is {width}x{height} = {width * height} pixels, more than "
                                     f"Limits.max_image_pixels = {self.limits.max_image_pixels}")
            self.check_allocation((height, width, _CHANNELS[fmt]), "decoded image")
            if img.mode in ("I", "F"):  # 32-bit integer or float samples: no 8-bit reading is defined
                raise op_error(self, f"the image has 32-bit samples (Pillow mode {img.mode!r}): not an 8-bit image")
            try:
                return np.ascontiguousarray(self._pixels(img, fmt))
            except Exception as exc:  # noqa: BLE001 - a corrupt or truncated body
                raise self._undecodable(encoded, exc) from None

    def _undecodable(self, encoded: np.ndarray, exc: Exception) -> Exception:
        return op_error(self, f"cannot decode the image ({len(encoded)} bytes; formats read: "
                              f"{', '.join(FORMATS)}): {type(exc).__name__}: {exc}")

    def _pixels(self, img: Any, fmt: str) -> np.ndarray:
        if img.mode in _SIXTEEN_BIT:  # 16-bit grey: the high byte (Pillow would clip to 255)
            img = self.image.fromarray((np.asarray(img, dtype=np.uint16) >> 8).astype(np.uint8), mode="L")
        if fmt == "Grayscale":
            return np.asarray(img.convert("L"), dtype=np.uint8)[:, :, np.newaxis]
        rgb = np.asarray(img if img.mode == "RGB" else img.convert("RGB"), dtype=np.uint8)
        return rgb[:, :, ::-1] if fmt == "BGR" else rgb
