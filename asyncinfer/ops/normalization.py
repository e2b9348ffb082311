"""Normalization ops: BatchNormalization (inference and training mode), LayerNormalization, InstanceNormalization,
GroupNormalization, LRN, MeanVarianceNormalization, LpNormalization and RMSNormalization.

Per-channel affine work is folded into one multiply-add on the big tensor; statistics are computed
in float32 (or the requested ``stash_type``) and never in float64 for float32 data.
"""
from __future__ import annotations

import math

import numpy as np
import onnx.defs
from onnx import TensorProto, helper

from ..model.ir import Layer
from .base import Op
from .compiled.normalization import add_layer_norm_rows, layer_norm_rows, rms_norm_rows
from .epilogue import Activations, apply_activations
from .fused import FUSED_DOMAIN
from .one_pass import fused_affine
from .registry import create, register
from .shape import op_error


def _stash_dtype(op: Op) -> np.dtype:
    """The NumPy dtype of the ``stash_type`` attribute (default float32)."""
    stash = int(op.attr("stash_type", TensorProto.FLOAT))
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(stash))
    except Exception:
        op.unsupported(f"stash_type={stash}")
        raise  # unreachable: unsupported() raises


def _check_stash(op: Op) -> None:
    dt = _stash_dtype(op)
    if dt.kind != "f" and dt.name != "bfloat16":
        op.unsupported(f"stash_type={op.attr('stash_type')}")


def _channel_shape(x: np.ndarray) -> tuple[int, ...]:
    """Shape that broadcasts a per-channel vector over an (N, C, ...) tensor."""
    return (x.shape[1],) + (1,) * (x.ndim - 2)


def _stats(x: np.ndarray, axes: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Mean and (biased) variance over ``axes`` (kept), computed in ``dtype``."""
    xs = x.astype(dtype, copy=False)
    mean = xs.mean(axis=axes, keepdims=True, dtype=dtype)
    centred = xs - mean
    var = np.square(centred).mean(axis=axes, keepdims=True, dtype=dtype)
    return mean, var


@register("BatchNormalization", versions=(1, 6, 7, 9, 14, 15))
class BatchNormalization(Op):
    """Batch norm. Inference mode is folded into ``x * a + b`` with per-channel ``a`` and ``b``.

    Training mode (``training_mode=1``, opset 14 on) normalizes with the batch's own statistics
    (mean and population variance over every axis but the channel one, computed in float32 at
    least) and, when asked, outputs ``running_mean = input_mean * momentum + mean * (1 - momentum)``
    and the same for the variance, as the definition and onnx.reference do. The training outputs of
    opsets before 14 (mean, var, saved_mean, saved_var, whose meaning the old specs leave open)
    are refused."""

    def check(self) -> None:
        self.training = self.version >= 14 and int(self.attr("training_mode", 0)) != 0
        if self.version < 9 and int(self.attr("spatial", 1)) != 1:
            self.unsupported("spatial=0")
        extra = sum(1 for o in self.layer.outputs[1:] if o)
        if extra and self.version < 14:
            self.unsupported("the training outputs of opsets before 14 (mean, var, saved_mean, saved_var)")
        if extra and not self.training:
            self.unsupported("running_mean/running_var outputs with training_mode=0")

    takes_activations = True  # (a float32 map's in one compiled pass: `one_pass.fused_affine`)

    def run(self, x: np.ndarray, scale: np.ndarray, bias: np.ndarray, mean: np.ndarray, var: np.ndarray, *,
            activations: Activations = ()) -> np.ndarray | tuple[np.ndarray, ...]:
        if self.training:
            y, *running = self._train(x, scale, bias, mean, var)
            return (apply_activations(y, activations, (x,)) if activations else y, *running)
        # the model's constant statistics fold once
        a, b = self.derived(f"folded-{x.dtype}", {1: scale, 2: bias, 3: mean, 4: var},
                            lambda: self._folded(x.dtype, scale, bias, mean, var))
        y = fused_affine(x, a, b, activations)
        if y is None:
            y = self._apply(x, a, b)
            if activations:
                y = apply_activations(y, activations, (x,))
        return y

    def _folded(self, dtype: np.dtype, scale: np.ndarray, bias: np.ndarray, mean: np.ndarray,
                var: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The per-channel ``a, b`` of ``x · a + b``, worked out in float32 at least (tiny vectors),
        as ``dtype`` (x's: the affine map applies them in it)."""
        eps = float(self.attr("epsilon"))
        work = np.promote_types(np.result_type(scale, var), np.float32)
        a = scale.astype(work) / np.sqrt(var.astype(work) + work.type(eps))
        return a.astype(dtype), (bias.astype(work) - mean.astype(work) * a).astype(dtype)

    @staticmethod
    def _apply(x: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        shape = _channel_shape(x)
        y = x * a.reshape(shape)
        y += b.reshape(shape)
        return y

    def _train(self, x: np.ndarray, scale: np.ndarray, bias: np.ndarray, mean: np.ndarray,
               var: np.ndarray) -> tuple[np.ndarray, ...]:
        if x.ndim < 2:
            raise op_error(self, f"training mode needs an input of rank 2 or more, got shape {x.shape}")
        work = np.promote_types(x.dtype, np.float32)
        axes = (0,) + tuple(range(2, x.ndim))
        batch_mean, batch_var = _stats(x, axes, work)
        y = self._apply(x, *self._folded(x.dtype, scale, bias, batch_mean.reshape(-1), batch_var.reshape(-1)))
        momentum = work.type(self.attr("momentum"))
        running = [(stat.astype(work) * momentum + batch.reshape(-1) * (work.type(1) - momentum)).astype(stat.dtype)
                   for stat, batch in ((mean, batch_mean), (var, batch_var))]
        return (y, *running)


@register("InstanceNormalization", versions=(1, 6, 22))
class InstanceNormalization(Op):
    """Normalize each (n, c) plane over its spatial dims, then scale and shift per channel."""

    def run(self, x: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> np.ndarray:
        eps = float(self.attr("epsilon"))
        work = np.promote_types(x.dtype, np.float32)
        mean, var = _stats(x, tuple(range(2, x.ndim)), work)
        shape = _channel_shape(x)
        a = scale.astype(work).reshape(shape) / np.sqrt(var + work.type(eps))
        b = bias.astype(work).reshape(shape) - mean * a
        return (x * a + b).astype(x.dtype, copy=False)


@register("LayerNormalization", versions=(17,))
class LayerNormalization(Op):
    """Normalize over dims ``axis..`` ; outputs Y, Mean and InvStdDev (in the stash type)."""

    def check(self) -> None:
        _check_stash(self)
        # parsed once: a transformer runs this op twice a block, every step
        self.axis, self.eps, self.stash = int(self.attr("axis")), float(self.attr("epsilon")), _stash_dtype(self)

    def run(self, x: np.ndarray, scale: np.ndarray, bias: np.ndarray | None = None):
        axis = self.axis + x.ndim if self.axis < 0 else self.axis
        eps, stash = self.eps, self.stash
        d = math.prod(x.shape[axis:])
        if (x.dtype == stash == np.float32 and x.size and scale.dtype == np.float32 and scale.size == d
                and (bias is None or (bias.dtype == np.float32 and bias.size == d))):
            return self._compiled(x, scale, bias, axis, eps)
        mean, var = _stats(x, tuple(range(axis, x.ndim)), stash)
        inv_std = (1.0 / np.sqrt(var + stash.type(eps))).astype(stash, copy=False)
        normed = ((x.astype(stash, copy=False) - mean) * inv_std).astype(x.dtype, copy=False)
        y = normed * scale
        if bias is not None:
            y += bias
        return y.astype(x.dtype, copy=False), mean, inv_std

    @staticmethod
    def _compiled(x: np.ndarray, scale: np.ndarray, bias: np.ndarray | None, axis: int,
                  eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """float32 with a full-size scale (and bias): one compiled pass per row (`compiled.normalization`)."""
        rows = x.reshape(-1, math.prod(x.shape[axis:]))
        stats_shape = x.shape[:axis] + (1,) * (x.ndim - axis)
        y = np.empty(x.shape, np.float32)
        mean = np.empty(stats_shape, np.float32)
        inv_std = np.empty(stats_shape, np.float32)
        flat_bias = scale.reshape(-1) if bias is None else np.ascontiguousarray(bias).reshape(-1)
        layer_norm_rows(np.ascontiguousarray(rows), np.ascontiguousarray(scale).reshape(-1), flat_bias,
                        bias is not None, eps, y.reshape(rows.shape), mean.reshape(-1), inv_std.reshape(-1))
        return y, mean, inv_std


@register("AddLayerNormalization", versions=(1,), domain=FUSED_DOMAIN)
class AddLayerNormalization(LayerNormalization):
    """``LayerNormalization(Add(A, B), scale, bias)`` over the last axis: the residual sum of a
    transformer block and the normalisation after it (``fuse_add_layer_norm``). Output 0 is the
    normalised sum; output 1, when the layer names one, the sum itself (the residual stream that
    a pre-norm block reads again). Attributes: LayerNormalization's ``epsilon`` and
    ``stash_type`` (``axis`` is -1).

    Float32 A and B of one shape, with float32 scale (and bias) of the last axis' size, take one
    pass over the rows (`compiled.normalization.add_layer_norm_rows`), the Add's float32 sums and
    the normalisation's arithmetic, so the bits of the two layers; any other case runs the
    ``Add`` and then the ``LayerNormalization``."""

    def check(self) -> None:
        if int(self.attr("axis", -1)) != -1 or len(self.layer.inputs) < 3 or not all(self.layer.inputs[:3]):
            self.unsupported("an AddLayerNormalization layer is made by the loader: A, B and scale, axis -1")
        super().check()
        self.keeps_sum = len(self.layer.outputs) > 1 and bool(self.layer.outputs[1])
        self._add = create(Layer(name=self.layer.name, op_type="Add", inputs=self.layer.inputs[:2],
                                 outputs=[self.layer.name + "/sum"], version=14), self.limits)

    def run(self, a: np.ndarray, b: np.ndarray, scale: np.ndarray,  # type: ignore[override]
            bias: np.ndarray | None = None) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        d = a.shape[-1] if a.ndim else 0
        if (a.dtype == b.dtype == self.stash == scale.dtype == np.float32 and a.shape == b.shape and a.size
                and scale.size == d and (bias is None or (bias.dtype == np.float32 and bias.size == d))):
            y = np.empty(a.shape, np.float32)
            total = np.empty(a.shape, np.float32) if self.keeps_sum else y
            rows = (-1, d)
            add_layer_norm_rows(np.ascontiguousarray(a).reshape(rows), np.ascontiguousarray(b).reshape(rows),
                                np.ascontiguousarray(scale).reshape(-1),
                                scale.reshape(-1) if bias is None else np.ascontiguousarray(bias).reshape(-1),
                                bias is not None, self.eps, y.reshape(rows), total.reshape(rows), self.keeps_sum)
            return (y, total) if self.keeps_sum else y
        total = self._add.run(a, b)
        y = LayerNormalization.run(self, total, scale, bias)[0]
        return (y, total) if self.keeps_sum else y


@register("GroupNormalization", versions=(18, 21))
class GroupNormalization(Op):
    """Normalize over (channels of a group, spatial dims); version 18 takes per-group scale/bias."""

    def check(self) -> None:
        if int(self.attr("num_groups", 0)) < 1:
            self.unsupported(f"num_groups={self.attr('num_groups', None)}")
        _check_stash(self)

    def run(self, x: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> np.ndarray:
        groups = int(self.attr("num_groups"))
        eps = float(self.attr("epsilon"))
        stash = _stash_dtype(self) if self.version >= 21 else np.promote_types(x.dtype, np.float32)
        n, c = x.shape[:2]
        xg = x.reshape((n, groups, -1))
        mean, var = _stats(xg, (2,), stash)
        normed = ((xg.astype(stash, copy=False) - mean) / np.sqrt(var + stash.type(eps)))
        normed = normed.astype(x.dtype, copy=False).reshape(x.shape)
        if self.version < 21:  # scale/bias hold one value per group
            scale, bias = np.repeat(scale, c // groups), np.repeat(bias, c // groups)
        shape = _channel_shape(x)
        return (normed * scale.reshape(shape) + bias.reshape(shape)).astype(x.dtype, copy=False)


@register("LRN", versions=(1, 13))
class LRN(Op):
    """Local response normalization across channels: a sliding sum of squares over ``size`` channels."""

    def check(self) -> None:
        if int(self.attr("size", 0)) < 1:
            self.unsupported(f"size={self.attr('size', None)}")

    def run(self, x: np.ndarray) -> np.ndarray:
        size = int(self.attr("size"))
        alpha, beta, bias = float(self.attr("alpha")), float(self.attr("beta")), float(self.attr("bias"))
        c = x.shape[1]
        lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2  # channels before / after each channel
        lo, hi = min(lo, c - 1), min(hi, c - 1)  # a window wider than the channels reaches them all
        sq = np.square(x)
        acc = sq.copy()
        for k in range(1, lo + 1):  # channel c - k contributes to channel c
            acc[:, k:] += sq[:, :c - k]
        for k in range(1, hi + 1):  # channel c + k
            acc[:, :c - k] += sq[:, k:]
        dt = x.dtype.type
        acc *= dt(alpha / size)
        acc += dt(bias)
        if beta == 0.75:  # acc**-0.75 as rsqrt(acc * sqrt(acc)): much faster than pow
            np.multiply(acc, np.sqrt(acc), out=acc)
            np.sqrt(acc, out=acc)
            return x / acc
        np.power(acc, dt(-beta), out=acc)
        return x * acc


@register("MeanVarianceNormalization", versions=(9, 13))
class MeanVarianceNormalization(Op):
    """``(x - E[x]) / (sqrt(E[x^2] - E[x]^2) + 1e-9)`` over ``axes`` (the ONNX function body)."""

    def run(self, x: np.ndarray) -> np.ndarray:
        axes = tuple(int(a) % x.ndim for a in self.attr("axes"))
        work = np.promote_types(x.dtype, np.float32)
        xs = x.astype(work, copy=False)
        mean = xs.mean(axis=axes, keepdims=True, dtype=work)
        var = np.square(xs).mean(axis=axes, keepdims=True, dtype=work) - np.square(mean)
        std = np.sqrt(np.maximum(var, 0)) + work.type(1e-9)
        return ((xs - mean) / std).astype(x.dtype, copy=False)


@register("LpNormalization", versions=(1, 22))
class LpNormalization(Op):
    """``x / ||x||_p`` along ``axis`` (p is 1 or 2); an all-zero slice stays zero."""

    def check(self) -> None:
        if int(self.attr("p")) not in (1, 2):
            self.unsupported(f"p={self.attr('p')}")

    def run(self, x: np.ndarray) -> np.ndarray:
        axis = int(self.attr("axis"))
        if int(self.attr("p")) == 1:
            norm = np.abs(x).sum(axis=axis, keepdims=True, dtype=x.dtype)
        else:
            norm = np.sqrt(np.square(x).sum(axis=axis, keepdims=True, dtype=x.dtype))
        safe = np.where(norm == 0, x.dtype.type(1), norm)
        return x / safe


def _has_rms_normalization() -> bool:
    try:
        onnx.defs.get_schema("RMSNormalization", 23)
        return True
    except Exception:
        return False


class RMSNormalization(Op):
    """``x / sqrt(mean(x^2 over axis..) + eps) * scale``, computed in the stash type."""

    def check(self) -> None:
        _check_stash(self)
        self.axis, self.eps, self.stash = int(self.attr("axis")), float(self.attr("epsilon")), _stash_dtype(self)

    def run(self, x: np.ndarray, scale: np.ndarray) -> np.ndarray:
        axis = self.axis + x.ndim if self.axis < 0 else self.axis
        eps, stash = self.eps, self.stash
        d = math.prod(x.shape[axis:])
        if x.dtype == stash == scale.dtype == np.float32 and x.size and scale.size == d:
            # one compiled pass per row (`compiled.normalization`): 10-20x the NumPy form's speed
            y = np.empty(x.shape, np.float32)
            rms_norm_rows(np.ascontiguousarray(x).reshape(-1, d), np.ascontiguousarray(scale).reshape(-1), eps,
                          y.reshape(-1, d))
            return y
        xs = x.astype(stash, copy=False)
        ms = np.square(xs).mean(axis=tuple(range(axis, x.ndim)), keepdims=True, dtype=stash)
        normed = (xs / np.sqrt(ms + stash.type(eps))).astype(x.dtype, copy=False)
        return (normed * scale).astype(x.dtype, copy=False)


if _has_rms_normalization():
    register("RMSNormalization", versions=(23,))(RMSNormalization)
