"""Signal-processing ops: DFT, STFT, the Hann/Hamming/Blackman windows and MelWeightMatrix.

Complex tensors are ONNX-style real tensors whose last axis of size 2 holds (real, imaginary)
(size 1 for a real signal). Transforms run in NumPy's pocketfft at the input's precision
(complex64 for float32 and narrower floats, as ONNX's expected outputs were computed) and are
cast back to the input's dtype; windows and the mel matrix are computed in float64 and cast to
``output_datatype``.
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np
from onnx import TensorProto

from ..dtypes import onnx_to_numpy
from .base import Op
from .registry import register
from .shape import MaybeArray, normalize_axis, op_error, scalar_input

Array = np.ndarray
# output_datatype values the window and mel ops accept (their T2/T3 type constraint)
_NUMERIC_OUTPUTS = {TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64,
                    TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64,
                    TensorProto.FLOAT16, TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.BFLOAT16}


def to_complex(op: Op, x: Array) -> Array:
    """The complex view (complex128 for float64, complex64 otherwise) of a signal tensor ``(..., 1 | 2)``."""
    if x.ndim < 2 or x.shape[-1] not in (1, 2):
        raise op_error(op, f"the last axis of a signal must have size 1 (real) or 2 (complex), got {x.shape}")
    dtype = np.complex128 if x.dtype == np.float64 else np.complex64
    z = np.empty(x.shape[:-1], dtype=dtype)
    z.real = x[..., 0]
    z.imag = x[..., 1] if x.shape[-1] == 2 else 0
    return z


def from_complex(z: Array, dtype: np.dtype) -> Array:
    """``(..., 2)`` real/imaginary tensor of ``dtype``."""
    return np.stack([z.real, z.imag], axis=-1).astype(dtype)


@register("DFT", versions=(17, 20))
class DFT(Op):
    """Full, one-sided (RFFT) or inverse (IFFT, IRFFT) DFT along one signal axis.

    Opset 17 takes the axis as an attribute (default 1), opset 20 as an optional input (default -2).
    """

    value_inputs = (1, 2)

    def run(self, x: Array, dft_length: MaybeArray = None, axis_input: MaybeArray = None) -> Array:
        z = to_complex(self, x)
        if self.version >= 20:
            axis = scalar_input(axis_input, -2)
        else:
            axis = self.attr("axis", 1)
        axis = normalize_axis(self, axis, x.ndim)
        if axis == x.ndim - 1:
            raise op_error(self, "the last axis holds the real/imaginary parts and cannot be transformed")
        inverse, onesided = bool(self.attr("inverse")), bool(self.attr("onesided"))
        size = x.shape[axis]
        n = scalar_input(dft_length, 2 * (size - 1) if inverse and onesided else size)
        if n < 1:
            raise op_error(self, f"dft_length {n} must be positive")
        self.check_allocation([*x.shape[:axis], n, *x.shape[axis + 1:]])
        if inverse and onesided:  # IRFFT: a real signal of length n from the half spectrum
            return np.fft.irfft(z, n, axis=axis)[..., None].astype(x.dtype)
        y = np.fft.ifft(z, n, axis=axis) if inverse else np.fft.fft(z, n, axis=axis)
        if onesided:
            y = np.take(y, np.arange(n // 2 + 1), axis=axis)
        return from_complex(y, x.dtype)


@register("STFT", versions=(17,))
class STFT(Op):
    """DFT of every (windowed) frame of a batch of signals ``(B, L, 1 | 2)`` → ``(B, frames, bins, 2)``."""

    value_inputs = (1, 3)

    def run(self, signal: Array, frame_step: Array, window: MaybeArray = None,
            frame_length: MaybeArray = None) -> Array:
        z = to_complex(self, signal)
        if z.ndim != 2:
            raise op_error(self, f"signal must have rank 3, got shape {signal.shape}")
        step = scalar_input(frame_step)
        length = scalar_input(frame_length, window.shape[0] if window is not None else z.shape[1])
        if window is not None and window.shape != (length,):
            raise op_error(self, f"window of shape {window.shape} for frame_length {length}")
        if step < 1 or not 1 <= length <= z.shape[1]:
            raise op_error(self, f"frame_step {step} / frame_length {length} invalid for {z.shape[1]} samples")
        frames = np.lib.stride_tricks.sliding_window_view(z, length, axis=1)[:, ::step]
        if window is not None:
            frames = frames * window.astype(frames.real.dtype)
        onesided = bool(self.attr("onesided"))
        if onesided and signal.shape[-1] == 2:
            raise op_error(self, "onesided=1 needs a real signal")
        spectrum = np.fft.rfft(frames.real, axis=-1) if onesided else np.fft.fft(frames, axis=-1)
        return from_complex(spectrum, signal.dtype)


def _output_dtype(op: Op) -> np.dtype:
    return onnx_to_numpy(int(op.attr("output_datatype", TensorProto.FLOAT)))


class _OutputTyped(Op):
    """Ops whose output dtype is the ``output_datatype`` attribute (a numeric ONNX type)."""

    value_inputs = (0,)

    def check(self) -> None:
        if int(self.attr("output_datatype", TensorProto.FLOAT)) not in _NUMERIC_OUTPUTS:
            self.unsupported(f"attribute output_datatype={self.attr('output_datatype')}")


class _Window(_OutputTyped):
    """``sum_k coeffs[k] * cos(2πkn / N)`` with N = size (periodic) or size - 1 (symmetric)."""

    coeffs: ClassVar[tuple[float, ...]]

    def run(self, size: Array) -> Array:
        n = scalar_input(size)
        if n < 0:
            raise op_error(self, f"window size {n} is negative")
        self.check_allocation([n])
        period = n if self.attr("periodic") else n - 1
        phase = 2 * np.pi * np.arange(n) / max(period, 1)
        w = sum(c * np.cos(k * phase) for k, c in enumerate(self.coeffs))
        return np.asarray(w, dtype=np.float64).astype(_output_dtype(self))


for _name, _coeffs in (("HannWindow", (0.5, -0.5)), ("HammingWindow", (25 / 46, -21 / 46)),
                       ("BlackmanWindow", (0.42, -0.5, 0.08))):
    register(_name, (17,))(type(_name, (_Window,), {"coeffs": _coeffs, "__doc__": f"ONNX {_name}."}))


def _hz_to_mel(hz: Array | float) -> Array:
    return 2595 * np.log10(1 + np.asarray(hz, dtype=np.float64) / 700)


def _mel_to_hz(mel: Array) -> Array:
    return 700 * (10 ** (mel / 2595) - 1)


@register("MelWeightMatrix", versions=(17,))
class MelWeightMatrix(_OutputTyped):
    """Triangular filters ``(dft_length // 2 + 1, num_mel_bins)`` on the spectrogram's bins.

    The band edges are evenly spaced in mel between the two edge frequencies and snapped down to
    whole spectrogram bins; each filter rises from 0 at its lower edge to 1 at its centre bin and
    falls back to 0 at its upper edge.
    """

    value_inputs = (0, 1, 2, 3, 4)

    def run(self, num_mel_bins: Array, dft_length: Array, sample_rate: Array,
            lower_edge_hertz: Array, upper_edge_hertz: Array) -> Array:
        mels, length, rate = scalar_input(num_mel_bins), scalar_input(dft_length), scalar_input(sample_rate)
        low, high = scalar_input(lower_edge_hertz, kind=float), scalar_input(upper_edge_hertz, kind=float)
        if mels < 1 or length < 1 or rate <= 0:
            raise op_error(self, f"invalid num_mel_bins {mels}, dft_length {length} or sample_rate {rate}")
        self.check_allocation([length // 2 + 1, mels])
        # mels + 2 band edges, one mel step apart, the step being a (mels + 2)-th of the range
        # (so the top edge stops short of upper_edge_hertz, as ONNX's expected output has it)
        low_mel = _hz_to_mel(low)
        edges_mel = low_mel + (_hz_to_mel(high) - low_mel) / (mels + 2) * np.arange(mels + 2)
        edges = np.floor((length + 1) * _mel_to_hz(edges_mel) / rate).astype(np.int64)
        lo, centre, hi = edges[:-2], edges[1:-1], edges[2:]
        j = np.arange(length // 2 + 1)[:, None]
        with np.errstate(all="ignore"):
            rising = np.where(centre == lo, 1.0, (j - lo) / (centre - lo))
            falling = (hi - j) / (hi - centre)
        w = np.where((j >= lo) & (j <= centre), rising, np.where((j > centre) & (j < hi), falling, 0.0))
        return w.astype(_output_dtype(self))
