"""ImageDecoder (asyncinfer/ops/image_decoder.py): Pillow-decoded images, checked against
onnx.reference's ImageDecoder (the definition) on the shipped node cases and on images made here in
every format and pixel mode; untrusted streams (corrupt, truncated, other formats, decompression
bombs) are clear errors that leave the worker usable; without Pillow the model is refused at load."""
from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from onnx.reference import ReferenceEvaluator

import asyncinfer as ai
from asyncinfer.ops import image_decoder
from node_cases import cases_using, run_node_case
from op_testing import one_node

Image = pytest.importorskip("PIL.Image", reason="Pillow (the 'image' extra, in 'dev') decodes the images")

FORMATS = {"BMP": "bmp", "JPEG": "jpeg", "JPEG2000": "j2k", "TIFF": "tiff", "PNG": "png", "WEBP": "webp",
           "PPM": "ppm"}


def encode(array: np.ndarray, fmt: str, mode: str | None = None, **options) -> np.ndarray:
    buffer = io.BytesIO()
    Image.fromarray(array, mode=mode).save(buffer, format=fmt, **options)
    return np.frombuffer(buffer.getvalue(), np.uint8)


def checkerboard(height: int = 24, width: int = 40, seed: int = 0) -> np.ndarray:
    colors = np.random.default_rng(seed).integers(0, 256, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    return np.repeat(np.repeat(colors, 8, axis=0), 8, axis=1)[:height, :width]


def decoder_model(encoded: np.ndarray, attrs: dict | None = None):
    """A one-node ImageDecoder model taking a stream of any length, and its feeds."""
    model, feeds = one_node("ImageDecoder", [encoded], attrs, opset=20)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "bytes"
    return model, feeds


def decode(encoded: np.ndarray, pixel_format: str = "RGB", limits: ai.Limits = ai.Limits()):
    model, feeds = decoder_model(encoded, dict(pixel_format=pixel_format))
    with ai.Worker(ai.load_model(model, limits=limits), "cpu") as worker:
        return worker.run_blocking(feeds)["o0"]


def reference(encoded: np.ndarray, pixel_format: str = "RGB") -> np.ndarray:
    model, feeds = one_node("ImageDecoder", [encoded], dict(pixel_format=pixel_format), opset=20)
    return ReferenceEvaluator(model).run(None, feeds)[0]


@pytest.mark.parametrize("name", sorted(cases_using({"ImageDecoder"})))
def test_node_cases_equal_the_shipped_outputs(name):
    for got, expected in run_node_case(name, "cpu")[0]:
        np.testing.assert_array_equal(got[0], expected[0])
        assert got[0].dtype == np.uint8


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("pixel_format", ["RGB", "BGR", "Grayscale"])
def test_every_format_and_pixel_format_equals_the_reference(fmt, pixel_format):
    encoded = encode(checkerboard(), fmt)
    got = decode(encoded, pixel_format)
    expected = reference(encoded, pixel_format)
    assert got.shape == expected.shape == (24, 40, 1 if pixel_format == "Grayscale" else 3)
    np.testing.assert_array_equal(got, expected)
    if fmt in ("BMP", "PNG", "TIFF", "PPM"):  # lossless: the very pixels
        rgb = checkerboard()
        np.testing.assert_array_equal(decode(encoded), rgb)
        np.testing.assert_array_equal(decode(encoded, "BGR"), rgb[:, :, ::-1])


def test_other_modes_are_converted_to_eight_bit_rgb():
    rgb = checkerboard()
    rgba = np.dstack([rgb, np.full(rgb.shape[:2], 7, np.uint8)])
    np.testing.assert_array_equal(decode(encode(rgba, "PNG")), rgb)  # alpha dropped
    grey = rgb[:, :, 0]
    np.testing.assert_array_equal(decode(encode(grey, "PNG")), np.repeat(grey[:, :, None], 3, axis=2))
    np.testing.assert_array_equal(decode(encode(grey, "PNG"), "Grayscale"), grey[:, :, None])
    palette = Image.fromarray(rgb).quantize(16)
    buffer = io.BytesIO()
    palette.save(buffer, format="PNG")
    np.testing.assert_array_equal(decode(np.frombuffer(buffer.getvalue(), np.uint8)),
                                  np.asarray(palette.convert("RGB")))
    deep = (np.arange(24 * 40, dtype=np.uint16).reshape(24, 40) * 67)
    np.testing.assert_array_equal(decode(encode(deep, "PNG"), "Grayscale")[:, :, 0], (deep >> 8).astype(np.uint8))


@pytest.mark.parametrize("data, match", [
    (np.frombuffer(b"not an image at all", np.uint8), "cannot decode the image"),
    (np.zeros(0, np.uint8), "cannot decode the image"),
    (encode(checkerboard(), "PNG")[:-40], "cannot decode the image"),  # truncated
    (encode(checkerboard(), "JPEG")[:-100], "cannot decode the image"),
    (encode(checkerboard(), "GIF"), "cannot decode the image"),  # not a format of the spec
])
def test_undecodable_streams_are_errors_and_the_worker_stays_usable(data, match):
    good = encode(checkerboard(), "PNG")
    model, _ = decoder_model(good)
    with ai.Worker(ai.load_model(model), "cpu") as worker:
        with pytest.raises(ai.ExecutionError, match=match):
            worker.run_blocking({"i0": data})
        np.testing.assert_array_equal(worker.run_blocking({"i0": good})["o0"], checkerboard())


def test_a_stream_that_is_not_one_dimensional_uint8_is_an_error():
    from asyncinfer.ops.registry import lookup
    from op_testing import make_op

    assert lookup("ImageDecoder", 20) is image_decoder.ImageDecoder
    op = make_op("ImageDecoder", version=20)
    for bad in (encode(checkerboard(), "PNG").astype(np.int32), encode(checkerboard(), "PNG").reshape(1, -1)):
        with pytest.raises(ai.ExecutionError, match="1-D uint8"):
            op(bad)


def _png_header_only(width: int, height: int) -> np.ndarray:
    """A PNG whose header claims ``width`` x ``height`` RGB pixels, with a few bytes of data."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))
    return np.frombuffer(data, np.uint8)


def test_decompression_bombs_are_refused_before_decoding():
    bomb = _png_header_only(60_000, 60_000)  # 3.6 billion pixels claimed in 80 bytes
    with pytest.raises(ai.ExecutionError, match="max_image_pixels|DecompressionBomb"):
        decode(bomb)
    bomb = _png_header_only(9000, 9000)  # over the default 8192 x 8192, under Pillow's own bound
    with pytest.raises(ai.ExecutionError, match="max_image_pixels"):
        decode(bomb)
    with pytest.raises(ai.ExecutionError, match="max_image_pixels = 100"):
        decode(encode(checkerboard(), "PNG"), limits=ai.Limits(max_image_pixels=100))


def test_without_pillow_the_model_is_refused_at_load_naming_the_extra(monkeypatch):
    monkeypatch.setattr(image_decoder, "pillow", lambda: None)
    model, _ = one_node("ImageDecoder", [encode(checkerboard(), "PNG")], opset=20)
    with pytest.raises(ai.UnsupportedOperatorError, match=r"asyncinfer\[image\]"):
        ai.load_model(model)


def test_an_unknown_pixel_format_is_refused_at_load():
    model, _ = one_node("ImageDecoder", [encode(checkerboard(), "PNG")], dict(pixel_format="CMYK"), opset=20)
    with pytest.raises(ai.UnsupportedOperatorError, match="pixel_format"):
        ai.load_model(model)
