"""Activation kernels. Single-input ones are ``elementwise_unary`` so the optimizer may fuse them.

Each activation is a float function of x and its attributes (with their ONNX defaults); the
:func:`~.elementwise.float_kernel` wrapper evaluates narrow floats in float32 and keeps x's dtype.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .base import Op
from .elementwise import erf, float_kernel
from .registry import register


def _define(name: str, versions: tuple[int, ...], fn: Callable[..., Any], **defaults: float) -> type[Op]:
    """Build and register a fusable activation computing ``fn(x, **attributes)``."""
    kernel = float_kernel(fn)

    def run(self: Op, x: np.ndarray) -> np.ndarray:
        return kernel(x, **{key: self.attr(key, default) for key, default in defaults.items()})

    cls = type(name, (Op,), {"run": run, "elementwise_unary": True, "__doc__": f"ONNX {name} activation."})
    return register(name, versions)(cls)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))  # exp overflow for x << 0 gives 1/inf = 0, which is right


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0, x)  # log(1 + e^x) without overflow


Relu = _define("Relu", (1, 6, 13, 14), lambda x: np.maximum(x, 0))
Relu.run_inplace = lambda self, x: np.maximum(x, 0, out=x)  # type: ignore[attr-defined]
_define("Sigmoid", (1, 6, 13), _sigmoid)
_define("Tanh", (1, 6, 13), np.tanh)
_define("HardSigmoid", (1, 6, 22), lambda x, alpha, beta: np.clip(alpha * x + beta, 0, 1), alpha=0.2, beta=0.5)
_define("HardSwish", (14, 22), lambda x: x * np.clip(x / 6 + 0.5, 0, 1))
_define("LeakyRelu", (1, 6, 16), lambda x, alpha: np.where(x >= 0, x, alpha * x), alpha=0.01)
_define("Elu", (1, 6, 22), lambda x, alpha: np.where(x > 0, x, alpha * np.expm1(x)), alpha=1.0)
_define("Selu", (1, 6, 22), lambda x, alpha, gamma: gamma * np.where(x > 0, x, alpha * np.expm1(x)),
        alpha=1.67326319217681884765625, gamma=1.05070102214813232421875)
_define("Celu", (12, 28), lambda x, alpha: np.maximum(x, 0) + np.minimum(0, alpha * np.expm1(x / alpha)), alpha=1.0)
_define("Softplus", (1, 22), _softplus)
_define("Softsign", (1, 22), lambda x: x / (1 + np.abs(x)))
_define("ThresholdedRelu", (10, 22), lambda x, alpha: np.where(x > alpha, x, 0), alpha=1.0)
_define("Mish", (18, 22), lambda x: x * np.tanh(_softplus(x)))
_define("Shrink", (9,), lambda x, lambd, bias: np.where(x < -lambd, x + bias, np.where(x > lambd, x - bias, 0)),
        lambd=0.5, bias=0.0)


@float_kernel
def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + erf(x / math.sqrt(2)).astype(x.dtype, copy=False))


@float_kernel
def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


@register("Gelu", versions=(20,))
class Gelu(Op):
    """Exact (erf) Gelu, or its tanh approximation with ``approximate="tanh"``."""

    elementwise_unary = True

    def check(self) -> None:
        if self.attr("approximate", "none") not in ("none", "tanh"):
            self.unsupported(f"approximate={self.attr('approximate')!r}")

    def run(self, x: np.ndarray) -> np.ndarray:
        return (_gelu_tanh if self.attr("approximate", "none") == "tanh" else _gelu)(x)


@register("PRelu", versions=(7, 9, 16))
class PRelu(Op):
    """x for x >= 0, slope * x otherwise; slope broadcasts to x (opset 6 and older are not supported)."""

    def run(self, x: np.ndarray, slope: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):
            return np.asarray(np.where(x < 0, x * slope.astype(x.dtype, copy=False), x)).astype(x.dtype, copy=False)
