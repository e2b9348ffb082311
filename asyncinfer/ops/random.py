"""Random generators: RandomNormal/Uniform(+Like), Bernoulli, Multinomial.

They are never constant-folded (``deterministic = False``). With a ``seed`` attribute every run
draws the same values (a fresh generator per run keeps runs on different threads independent);
without one, each run draws fresh values from OS entropy. ONNX's node cases for these ops compare
against one particular generator's stream, which no other implementation reproduces.
"""
from __future__ import annotations

import numpy as np

from ..dtypes import onnx_to_numpy
from .base import Op
from .registry import register

class _Random(Op):
    deterministic = False

    def rng(self) -> np.random.Generator:
        seed = self.attr("seed", None)
        # ONNX's seed is a float; its bit pattern makes an exact, reproducible integer seed
        return np.random.default_rng(None if seed is None else np.float32(seed).view(np.uint32).item())

    def out_dtype(self, like: np.ndarray | None = None) -> np.dtype:
        code = self.attr("dtype", None)
        if code is None:
            return like.dtype if like is not None else np.dtype(np.float32)
        return onnx_to_numpy(int(code))

    def check(self) -> None:
        code = self.attr("dtype", None)
        if code is not None and onnx_to_numpy(int(code)).kind not in "fiub":
            self.unsupported(f"dtype={code}")


@register("RandomNormal", versions=(1, 22))
class RandomNormal(_Random):
    def run(self) -> np.ndarray:
        shape = tuple(int(d) for d in self.attr("shape"))
        self.check_allocation(shape)
        draw = self.rng().standard_normal(shape) * self.attr("scale") + self.attr("mean")
        return draw.astype(self.out_dtype())


@register("RandomUniform", versions=(1, 22))
class RandomUniform(_Random):
    def run(self) -> np.ndarray:
        shape = tuple(int(d) for d in self.attr("shape"))
        self.check_allocation(shape)
        draw = self.rng().uniform(self.attr("low"), self.attr("high"), shape)
        return draw.astype(self.out_dtype())


@register("RandomNormalLike", versions=(1, 22))
class RandomNormalLike(_Random):
    def run(self, x: np.ndarray) -> np.ndarray:
        draw = self.rng().standard_normal(x.shape) * self.attr("scale") + self.attr("mean")
        return draw.astype(self.out_dtype(x))


@register("RandomUniformLike", versions=(1, 22))
class RandomUniformLike(_Random):
    def run(self, x: np.ndarray) -> np.ndarray:
        draw = self.rng().uniform(self.attr("low"), self.attr("high"), x.shape)
        return draw.astype(self.out_dtype(x))


@register("Bernoulli", versions=(15, 22))
class Bernoulli(_Random):
    """1 with probability ``x`` (elementwise), else 0, in ``dtype`` (default: x's dtype)."""

    def run(self, x: np.ndarray) -> np.ndarray:
        return (self.rng().random(x.shape) < x).astype(self.out_dtype(x))


@register("Multinomial", versions=(7, 22))
class Multinomial(_Random):
    """``sample_size`` class indices per batch row, drawn from the softmax of the row's log-weights."""

    def check(self) -> None:
        code = self.attr("dtype")  # TensorProto.INT32
        if onnx_to_numpy(int(code)) not in (np.dtype(np.int32), np.dtype(np.int64)):
            self.unsupported(f"dtype={code} (int32 or int64 only)")

    def run(self, x: np.ndarray) -> np.ndarray:
        logits = x.astype(np.float64)
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        cdf = np.cumsum(p / p.sum(axis=1, keepdims=True), axis=1)
        self.check_allocation([x.shape[0], int(self.attr("sample_size")), x.shape[1]], "scratch")
        u = self.rng().random((x.shape[0], int(self.attr("sample_size"))))
        # index of the first class whose cumulative probability exceeds the uniform draw
        idx = (u[:, :, None] >= cdf[:, None, :]).sum(axis=2)
        return np.minimum(idx, x.shape[1] - 1).astype(onnx_to_numpy(int(self.attr("dtype"))))
