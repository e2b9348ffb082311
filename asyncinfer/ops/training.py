"""Optimizer steps of the ``ai.onnx.preview.training`` domain: Adagrad, Adam, Momentum.

Each is a pure function of its inputs ``R`` (learning rate), ``T`` (update count) and, per
optimized tensor, its value, gradient and optimizer state. The inputs after R and T come grouped
by kind (``X1, X2, G1, G2, H1, H2``) and so do the outputs (``X1_new, X2_new, H1_new, H2_new``).
Arithmetic is done in float64 and each output is cast back to its tensor's dtype.
"""
from __future__ import annotations

import numpy as np

from .base import Op
from .registry import register
from .shape import check_mode, op_error

Array = np.ndarray
DOMAIN = "ai.onnx.preview.training"


class _Optimizer(Op):
    """Splits the variadic inputs into ``groups`` lists (X, G, then the state tensors)."""

    groups = 3

    def split(self, r: Array, t: Array, tensors: tuple[Array, ...]) -> tuple[float, int, list[list[Array]]]:
        if len(tensors) == 0 or len(tensors) % self.groups:
            raise op_error(self, f"{len(tensors)} tensor inputs is not a multiple of {self.groups}")
        n = len(tensors) // self.groups
        grouped = [[np.asarray(a, dtype=np.float64) for a in tensors[k * n:(k + 1) * n]] for k in range(self.groups)]
        return float(np.asarray(r).reshape(-1)[0]), int(np.asarray(t).reshape(-1)[0]), grouped

    def outputs(self, results: list[list[Array]], tensors: tuple[Array, ...]) -> tuple[Array, ...]:
        """Flatten the per-kind results (X, then the states: input kinds 0, 2, 3…), each tensor in
        the dtype of the input it updates."""
        n = len(tensors) // self.groups
        kinds = [0] + list(range(2, self.groups))
        return tuple(np.asarray(a).astype(np.asarray(tensors[kind * n + i]).dtype)
                     for kind, result in zip(kinds, results) for i, a in enumerate(result))


@register("Adagrad", versions=(1,), domain=DOMAIN)
class Adagrad(_Optimizer):
    def run(self, r: Array, t: Array, *tensors: Array) -> tuple[Array, ...]:
        rate, step, (xs, gs, hs) = self.split(r, t, tensors)
        norm, eps = self.attr("norm_coefficient"), self.attr("epsilon")
        rate = rate / (1 + step * self.attr("decay_factor"))
        new_x, new_h = [], []
        for x, g, h in zip(xs, gs, hs):
            g = norm * x + g
            h = h + g * g
            new_x.append(x - rate * g / (np.sqrt(h) + eps))
            new_h.append(h)
        return self.outputs([new_x, new_h], tensors)


@register("Adam", versions=(1,), domain=DOMAIN)
class Adam(_Optimizer):
    groups = 4

    def run(self, r: Array, t: Array, *tensors: Array) -> tuple[Array, ...]:
        rate, step, (xs, gs, vs, hs) = self.split(r, t, tensors)
        alpha, beta = self.attr("alpha"), self.attr("beta")
        norm, eps = self.attr("norm_coefficient"), self.attr("epsilon")
        post = self.attr("norm_coefficient_post")
        if step > 0:  # bias correction of both running averages
            rate = rate * np.sqrt(1 - beta ** step) / (1 - alpha ** step)
        new_x, new_v, new_h = [], [], []
        for x, g, v, h in zip(xs, gs, vs, hs):
            g = norm * x + g
            v = alpha * v + (1 - alpha) * g
            h = beta * h + (1 - beta) * g * g
            new_x.append((1 - post) * (x - rate * v / (np.sqrt(h) + eps)))
            new_v.append(v)
            new_h.append(h)
        return self.outputs([new_x, new_v, new_h], tensors)


@register("Momentum", versions=(1,), domain=DOMAIN)
class Momentum(_Optimizer):
    def check(self) -> None:
        check_mode(self, "mode", "standard", ("standard", "nesterov"))
        for name in ("alpha", "beta", "norm_coefficient", "mode"):
            self.attr(name)  # all required: refuse the model at load when one is missing

    def run(self, r: Array, t: Array, *tensors: Array) -> tuple[Array, ...]:
        rate, step, (xs, gs, vs) = self.split(r, t, tensors)
        alpha, norm = self.attr("alpha"), self.attr("norm_coefficient")
        beta = self.attr("beta") if step > 0 else 1.0  # the first step takes the whole gradient
        nesterov = self.attr("mode") == "nesterov"
        new_x, new_v = [], []
        for x, g, v in zip(xs, gs, vs):
            g = norm * x + g
            v = alpha * v + beta * g
            new_x.append(x - rate * (g + alpha * v if nesterov else v))
            new_v.append(v)
        return self.outputs([new_x, new_v], tensors)
