"""The ``com.microsoft`` ops of ONNX Runtime's transformer optimizer, on NumPy.

``onnxruntime.transformers.optimizer`` rewrites BERT / GPT-2 / LLaMA-style graphs into these fused
ops. Their semantics are ORT's operator documentation (ContribOperators.md) and, where that text is
silent, what ORT's CPU kernels compute (each class says which). Wherever the math is an ONNX op's,
the ONNX kernel computes it — one op semantics written once:

- GELU forms (Gelu, BiasGelu, FastGelu, BiasSplitGelu) and QuickGelu are the ``Gelu`` and
  ``Swish`` lines of the element-wise table (`asyncinfer.ops.pointwise`);
- the layer norms are ONNX ``LayerNormalization`` / ``RMSNormalization`` kernels applied to the
  summed input;
- FusedGemm / FusedConv are the ONNX ``Gemm`` / ``Conv`` kernels plus an activation of the
  element-wise table;
- Attention, MultiHeadAttention and GroupQueryAttention turn their masks, paddings and caches into
  the additive bias of the ONNX ``Attention`` kernel (opset 23), which then computes the scores,
  softmax (with softcap) and the grouped-query products; RotaryEmbedding is the ONNX
  ``RotaryEmbedding`` kernel.

Also registered here, in the ONNX domain, for the models ORT's tools write there:
``SimplifiedLayerNormalization`` (ORT's RMS norm, domain ``""``, version 1) and
``LayerNormalization`` version 1 (ORT's own schema, used by the optimizer's fusions in models of
opset < 17, before ONNX defined the op).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from onnx import helper

from ...model.ir import Layer
from ..attention import Attention as _OnnxAttention
from ..attention import RotaryEmbedding as _OnnxRotaryEmbedding
from ..base import Op
from ..conv import Conv
from ..elementwise import compute_dtype, float_kernel
from ..linalg import Gemm, gemm_dtypes, matmul
from ..normalization import LayerNormalization, RMSNormalization
from ..pointwise import ACTIVATIONS, UNARY_OPS
from ..registry import register
from ..schema import attribute_defaults, declare_defaults
from ..shape import op_error
from . import MS_DOMAIN

#: ONNX opset of the ONNX kernels reused here (their schema defaults are read at this opset).
_ONNX_OPSET = 23


def _inner(op: Op, op_type: str, attrs: dict[str, Any], inputs: Sequence[str] = (),
           outputs: Sequence[str] = ("y",), version: int = _ONNX_OPSET) -> Op:
    """An ONNX-domain kernel computing part of ``op`` (built once, at worker creation): same name,
    so its errors name the model's layer."""
    cls = {"LayerNormalization": LayerNormalization, "RMSNormalization": RMSNormalization,
           "Attention": _OnnxAttention, "RotaryEmbedding": _OnnxRotaryEmbedding}[op_type]
    layer = Layer(name=op.layer.name, op_type=op_type, inputs=list(inputs), outputs=list(outputs),
                  attrs=attrs, version=version)
    return cls(layer, op.limits)


def _wanted(op: Op, index: int) -> bool:
    """Whether the model reads output ``index`` of ``op``'s layer (optional outputs are skipped)."""
    return len(op.layer.outputs) > index and bool(op.layer.outputs[index])


def _given(op: Op, index: int) -> bool:
    """Whether the layer has optional input ``index``."""
    return len(op.layer.inputs) > index and bool(op.layer.inputs[index])


def _last_axis(op: Op, x: np.ndarray, vector: np.ndarray | None, what: str) -> None:
    """Refuse a 1-D parameter that does not match ``x``'s last dimension (NumPy would broadcast
    a wrong length of 1 silently)."""
    if vector is not None and (vector.ndim != 1 or x.ndim == 0 or vector.shape[0] != x.shape[-1]):
        raise op_error(op, f"{what} of shape {vector.shape} does not match the hidden size "
                           f"{x.shape[-1] if x.ndim else None} of the input {x.shape}")


# --------------------------------------------------------------------------------------------------
# GELU family and activations
# --------------------------------------------------------------------------------------------------
_GELU_INPLACE = UNARY_OPS["Gelu"].inplace  # fn(xp, x, approximate): one compiled pass on float32
_SWISH = UNARY_OPS["Swish"].fn   # fn(xp, x, alpha): x * sigmoid(alpha * x)


@float_kernel
def _gelu(x: np.ndarray, approximate: str = "none", fresh: bool = False) -> np.ndarray:
    """GELU of ``x``, computed in place when ``x`` is ``fresh`` (a buffer nobody else reads)."""
    return _GELU_INPLACE(np, x if fresh else x.copy(), approximate)


def _biased(op: Op, x: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """``x + bias`` over the last axis, in x's dtype."""
    if bias is None:
        return x
    _last_axis(op, x, bias, "bias")
    return np.add(x, bias.astype(x.dtype, copy=False))


@register("Gelu", versions=(1,), domain=MS_DOMAIN)
class Gelu(Op):
    """GELU with the exact (erf) form: ONNX ``Gelu`` with ``approximate="none"``."""

    def run(self, x: np.ndarray) -> np.ndarray:
        return _gelu(x)


@register("BiasGelu", versions=(1,), domain=MS_DOMAIN)
class BiasGelu(Op):
    """``Gelu(A + B)`` (erf form), B a bias over the last axis."""

    def run(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return _gelu(_biased(self, a, b), fresh=True)


@register("FastGelu", versions=(1,), domain=MS_DOMAIN)
class FastGelu(Op):
    """The tanh approximation of GELU, ``0.5x(1 + tanh(0.7978845608(x + 0.044715x³)))``, of
    ``X + bias`` (bias optional): ONNX ``Gelu`` with ``approximate="tanh"``."""

    def run(self, x: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        return _gelu(_biased(self, x, bias), "tanh", fresh=bias is not None)


@register("QuickGelu", versions=(1,), domain=MS_DOMAIN)
class QuickGelu(Op):
    """``x * sigmoid(alpha * x)`` (alpha default 1.702): the ONNX ``Swish`` line of the table."""

    def run(self, x: np.ndarray) -> np.ndarray:
        return _SWISH_KERNEL(x, float(self.attr("alpha")))


_SWISH_KERNEL = float_kernel(lambda x, alpha: _SWISH(np, x, alpha))


@register("BiasAdd", versions=(1,), domain=MS_DOMAIN)
class BiasAdd(Op):
    """``X + bias + skip``: X and skip (N, S, C), bias (C)."""

    def run(self, x: np.ndarray, bias: np.ndarray, skip: np.ndarray) -> np.ndarray:
        if skip.shape != x.shape:
            raise op_error(self, f"skip of shape {skip.shape} does not match X of shape {x.shape}")
        return np.add(_biased(self, x, bias), skip.astype(x.dtype, copy=False))


@register("BiasSplitGelu", versions=(1,), domain=MS_DOMAIN)
class BiasSplitGelu(Op):
    """``left * Gelu(right)`` where ``left, right`` are the two halves of ``X + bias`` along the
    last axis (erf GELU): (N, S, D) → (N, S, D/2)."""

    def run(self, x: np.ndarray, bias: np.ndarray) -> np.ndarray:
        if x.shape[-1] % 2:
            raise op_error(self, f"the last dimension {x.shape[-1]} of X is not even")
        h = _biased(self, x, bias)
        half = h.shape[-1] // 2
        return (h[..., :half] * _gelu(np.array(h[..., half:]), fresh=True)).astype(x.dtype, copy=False)


def _activation(op: Op, name: str, values: Sequence[float] | dict[str, float]) -> Callable[[np.ndarray], np.ndarray]:
    """The activation ``name`` (an ONNX op type of the element-wise table, or Clip) as a function of
    a float array, its parameters given by position (FusedConv's ``activation_params``) or by name
    (FusedGemm's ``activation_alpha/beta/gamma``); parameters left out take the ONNX op's defaults."""
    if name == "Clip":
        bounds = list(values.values()) if isinstance(values, dict) else list(values)
        lo = bounds[0] if len(bounds) > 0 else -np.inf
        hi = bounds[1] if len(bounds) > 1 else np.inf
        return lambda y: np.clip(y, y.dtype.type(lo), y.dtype.type(hi))
    entry = ACTIVATIONS.get(name)
    if entry is None:
        op.unsupported(f"activation={name!r}")
        raise AssertionError("unreachable")
    params = dict(attribute_defaults(name, _ONNX_OPSET))
    if isinstance(values, dict):
        params.update({k: v for k, v in values.items() if k in entry.attributes})
    else:
        if len(values) > len(entry.attributes):
            op.unsupported(f"{len(values)} activation_params for {name} (it takes {list(entry.attributes)})")
        params.update(zip(entry.attributes, values))
    missing = [a for a in entry.attributes if a not in params]
    if missing:
        op.unsupported(f"activation {name} without {missing}")
    kwargs = {a: params[a] for a in entry.attributes}
    for choice, allowed in entry.choices.items():
        if kwargs.get(choice) not in allowed:
            op.unsupported(f"activation {name} with {choice}={kwargs.get(choice)!r}")
    return lambda y: np.asarray(entry.fn(np, y, **kwargs)).astype(y.dtype, copy=False)


# --------------------------------------------------------------------------------------------------
# Fused GEMMs and convolution
# --------------------------------------------------------------------------------------------------
def _batch_transposed(x: np.ndarray, trans_batch: bool, trans: bool) -> np.ndarray:
    """FusedMatMul's view of an operand: with ``transBatch`` the first axis moves behind the batch
    axes, ``(d0, d1 .. d[r-2], d[r-1])`` → ``(d1 .. d[r-2], d0, d[r-1])``; ``trans`` then swaps
    the last two axes (ORT's CPU kernel: with both, ``(d1 .. d[r-2], d[r-1], d0)``)."""
    if x.ndim < 2:
        return x
    if trans_batch:
        x = np.moveaxis(x, 0, -2)
    return np.swapaxes(x, -1, -2) if trans else x


@register("FusedMatMul", versions=(1,), domain=MS_DOMAIN)
class FusedMatMul(Op):
    """``alpha * (A' @ B')`` with NumPy matmul broadcasting, where ``'`` is the optional transpose
    of the last two axes (``transA``/``transB``) after the optional batch transpose
    (``transBatchA``/``transBatchB``, see `_batch_transposed`)."""

    multithreaded = True

    def run(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a = _batch_transposed(a, bool(self.attr("transBatchA")), bool(self.attr("transA")))
        b = _batch_transposed(b, bool(self.attr("transBatchB")), bool(self.attr("transB")))
        work, out = gemm_dtypes(a, b)
        if a.ndim >= 1 and b.ndim >= 1 and a.shape[-1] != b.shape[-2 if b.ndim > 1 else 0]:
            raise op_error(self, f"A {a.shape} and B {b.shape} (after the transposes) do not chain")
        y = matmul(a.astype(work, copy=False), b.astype(work, copy=False))
        alpha = float(self.attr("alpha"))
        if alpha != 1.0:
            y = y * y.dtype.type(alpha)
        return np.asarray(y).astype(out, copy=False)


@register("FusedGemm", versions=(1,), domain=MS_DOMAIN)
class FusedGemm(Gemm):
    """ONNX ``Gemm`` followed by the activation named by ``activation`` (an ONNX activation op
    type: Relu, LeakyRelu, Sigmoid, Tanh, HardSigmoid, Elu…; none when absent), its parameters
    from ``activation_alpha``/``activation_beta``/``activation_gamma`` (else the ONNX defaults)."""

    def check(self) -> None:
        super().check()
        name = self.attr("activation", None)
        params = {key: float(self.attrs[f"activation_{key}"]) for key in ("alpha", "beta", "gamma")
                  if f"activation_{key}" in self.attrs}
        self.act = None if name is None else _activation(self, str(name), params)

    def run(self, a: np.ndarray, b: np.ndarray, c: np.ndarray | None = None) -> np.ndarray:
        y = super().run(a, b, c)
        if self.act is None:
            return y
        return _float_apply(y, self.act)


def _float_apply(y: np.ndarray, fn: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """``fn(y)`` computed in y's compute dtype (float32 for narrow floats), in y's dtype."""
    return fn(y.astype(compute_dtype(y.dtype), copy=False)).astype(y.dtype, copy=False)


@register("FusedConv", versions=(1,), domain=MS_DOMAIN)
class FusedConv(Conv):
    """``activation(Conv(X, W, B) + Z)``: the ONNX ``Conv`` kernel, the optional ``Z`` added (ORT's
    "sum" input, same shape as the result) before the activation; ``activation_params`` gives its
    parameters by position (LeakyRelu: alpha; HardSigmoid: alpha, beta; Clip: min, max)."""

    def check(self) -> None:
        super().check()
        name = self.attr("activation", None)
        params = [float(v) for v in self.attr("activation_params", None) or []]
        self.act = None if name is None else _activation(self, str(name), params)

    def run(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None,
            z: np.ndarray | None = None) -> np.ndarray:
        y = super().run(x, w, b)
        if z is not None:
            if z.shape != y.shape:
                raise op_error(self, f"Z of shape {z.shape} does not match the convolution's result {y.shape}")
            y = np.add(y, z.astype(y.dtype, copy=False))
        return y if self.act is None else _float_apply(y, self.act)


# --------------------------------------------------------------------------------------------------
# Layer normalizations
# --------------------------------------------------------------------------------------------------
def _inv_rms(x: np.ndarray, axes: tuple[int, ...], eps: float, stash: np.dtype) -> np.ndarray:
    """``1 / sqrt(mean(x²) + eps)`` over ``axes`` (kept), in ``stash``: the inv_std_var output of
    ORT's RMS norms (their Y is the ONNX RMSNormalization kernel's)."""
    xs = x.astype(stash, copy=False)
    ms = np.square(xs).mean(axis=axes, keepdims=True, dtype=stash)
    return (1.0 / np.sqrt(ms + stash.type(eps))).astype(stash, copy=False)


class _SimplifiedLayerNormalization(RMSNormalization):
    """ORT's RMS norm: ONNX ``RMSNormalization`` (axis, epsilon, stash_type), plus the optional
    ``inv_std_var`` output ``1/sqrt(mean(x²) + epsilon)`` in the stash type, reduced axes kept."""

    def run(self, x: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:  # type: ignore[override]
        y = super().run(x, scale)
        if not _wanted(self, 1):
            return y, None
        axis = int(self.attr("axis"))
        axis = axis + x.ndim if axis < 0 else axis
        stash = np.dtype(helper.tensor_dtype_to_np_dtype(int(self.attr("stash_type"))))
        return y, _inv_rms(x, tuple(range(axis, x.ndim)), float(self.attr("epsilon")), stash)


_NORM_DEFAULTS = {"axis": -1, "epsilon": 1e-5, "stash_type": 1}
declare_defaults("", "SimplifiedLayerNormalization", _NORM_DEFAULTS)
declare_defaults(MS_DOMAIN, "SimplifiedLayerNormalization", _NORM_DEFAULTS)
declare_defaults("", "LayerNormalization", _NORM_DEFAULTS)  # version 1 only: onnx knows 17 and later


@register("SimplifiedLayerNormalization", versions=(1,))
class SimplifiedLayerNormalization(_SimplifiedLayerNormalization):
    __doc__ = _SimplifiedLayerNormalization.__doc__ + (
        " ORT defines it in the ONNX domain (where its optimizer writes it), as version 1.")


@register("SimplifiedLayerNormalization", versions=(1,), domain=MS_DOMAIN)
class MsSimplifiedLayerNormalization(_SimplifiedLayerNormalization):
    __doc__ = _SimplifiedLayerNormalization.__doc__ + (
        " Also accepted in the com.microsoft domain (ORT itself knows it only in the ONNX domain).")


# ORT's LayerNormalization schema of the ONNX domain, version 1 (for opsets before 17): the math of
# ONNX's version 17, which its fusions emit whatever the model's opset.
register("LayerNormalization", versions=(1,))(LayerNormalization)


def _skip_sum(op: Op, x: np.ndarray, skip: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """``input + skip (+ bias)`` in the input's dtype; skip may be (B, S, H), (1, S, H) or (S, H)."""
    if x.ndim not in (2, 3) or skip.shape[-2:] != x.shape[-2:] or skip.ndim > x.ndim \
            or (skip.ndim == 3 and skip.shape[0] not in (1, x.shape[0])):
        raise op_error(op, f"skip of shape {skip.shape} does not fit the input of shape {x.shape}")
    s = np.add(x, skip.astype(x.dtype, copy=False))
    if bias is not None:
        _last_axis(op, x, bias, "bias")
        s += bias.astype(x.dtype, copy=False)
    return s


@register("SkipLayerNormalization", versions=(1,), domain=MS_DOMAIN)
class SkipLayerNormalization(Op):
    """``LayerNormalization(input + skip + bias) * gamma + beta`` over the last axis (epsilon
    default 1e-12, statistics in float32), with the optional outputs ``mean`` and ``inv_std_var``
    (float32, shape (…, 1)) and ``input_skip_bias_sum``."""

    def check(self) -> None:
        self.norm = _inner(self, "LayerNormalization",
                           {"axis": -1, "epsilon": float(self.attr("epsilon")), "stash_type": 1},
                           outputs=("y", "mean", "inv_std"))

    def run(self, x: np.ndarray, skip: np.ndarray, gamma: np.ndarray, beta: np.ndarray | None = None,
            bias: np.ndarray | None = None) -> tuple[np.ndarray | None, ...]:
        s = _skip_sum(self, x, skip, bias)
        _last_axis(self, s, gamma, "gamma")
        _last_axis(self, s, beta, "beta")
        y, mean, inv_std = self.norm.run(s, gamma.astype(s.dtype, copy=False),
                                         None if beta is None else beta.astype(s.dtype, copy=False))
        return y, mean, inv_std, s


@register("SkipSimplifiedLayerNormalization", versions=(1,), domain=MS_DOMAIN)
class SkipSimplifiedLayerNormalization(Op):
    """``RMSNormalization(input + skip + bias) * gamma`` over the last axis (epsilon default
    1e-12, in float32), with the optional outputs ``mean`` (zeros: an RMS norm has none; ORT
    writes zeros too), ``inv_std_var`` (float32, shape (…, 1)) and ``input_skip_bias_sum``."""

    def check(self) -> None:
        self.eps = float(self.attr("epsilon"))
        self.norm = _inner(self, "RMSNormalization", {"axis": -1, "epsilon": self.eps, "stash_type": 1})

    def run(self, x: np.ndarray, skip: np.ndarray, gamma: np.ndarray,
            bias: np.ndarray | None = None) -> tuple[np.ndarray | None, ...]:
        s = _skip_sum(self, x, skip, bias)
        _last_axis(self, s, gamma, "gamma")
        y = self.norm.run(s, gamma.astype(s.dtype, copy=False))
        stats_shape = s.shape[:-1] + (1,)
        mean = np.zeros(stats_shape, np.float32) if _wanted(self, 1) else None
        inv = _inv_rms(s, (s.ndim - 1,), self.eps, np.dtype(np.float32)) if _wanted(self, 2) else None
        return y, mean, inv, s


declare_defaults(MS_DOMAIN, "SkipLayerNormalization", {"epsilon": 1e-12})
declare_defaults(MS_DOMAIN, "SkipSimplifiedLayerNormalization", {"epsilon": 1e-12})


@register("EmbedLayerNormalization", versions=(1,), domain=MS_DOMAIN)
class EmbedLayerNormalization(Op):
    """BERT's embeddings: ``LayerNormalization(word[input_ids] + position[position_ids] +
    segment[segment_ids]) * gamma + beta`` (epsilon default 1e-12). ``position_ids`` defaults to
    ``0..S-1`` and may be (B, S) or (1, S); the segment terms are optional. Outputs: the normalized
    sum, ``mask_index`` (int32, per batch row the number of ones in ``mask``, as ORT's CPU kernel
    counts them; zeros without a mask) and ``embedding_sum`` (the sum before normalization)."""

    def check(self) -> None:
        self.norm = _inner(self, "LayerNormalization",
                           {"axis": -1, "epsilon": float(self.attr("epsilon")), "stash_type": 1},
                           outputs=("y", "mean", "inv_std"))

    def _lookup(self, table: np.ndarray, ids: np.ndarray, what: str) -> np.ndarray:
        ids = ids.astype(np.int64, copy=False)
        if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
            raise op_error(self, f"{what} ids must lie in [0, {table.shape[0]}), got values in "
                                 f"[{ids.min()}, {ids.max()}]")
        return table[ids]

    def run(self, input_ids: np.ndarray, segment_ids: np.ndarray | None, word: np.ndarray, position: np.ndarray,
            segment: np.ndarray | None, gamma: np.ndarray, beta: np.ndarray, mask: np.ndarray | None = None,
            position_ids: np.ndarray | None = None) -> tuple[np.ndarray | None, ...]:
        if input_ids.ndim != 2:
            raise op_error(self, f"input_ids must be 2-D (batch, sequence), got shape {input_ids.shape}")
        batch, seq = input_ids.shape
        for name, table in (("word_embedding", word), ("position_embedding", position), ("segment_embedding", segment)):
            if table is not None and (table.ndim != 2 or table.shape[1] != word.shape[-1]):
                raise op_error(self, f"{name} of shape {table.shape} is not (rows, {word.shape[-1]})")
        if position_ids is None:
            position_ids = np.arange(seq, dtype=np.int64)[None]
        elif position_ids.shape not in ((batch, seq), (1, seq)):
            raise op_error(self, f"position_ids of shape {position_ids.shape} is not ({batch}, {seq}) nor (1, {seq})")
        total = self._lookup(word, input_ids, "input") + self._lookup(position, position_ids, "position")
        if segment_ids is not None and segment is not None:
            if segment_ids.shape != input_ids.shape:
                raise op_error(self, f"segment_ids of shape {segment_ids.shape} is not {input_ids.shape}")
            total = total + self._lookup(segment, segment_ids, "segment")
        total = total.astype(word.dtype, copy=False)
        y = self.norm.run(total, gamma.astype(total.dtype, copy=False), beta.astype(total.dtype, copy=False))[0]
        if mask is not None:
            if mask.shape != input_ids.shape:
                raise op_error(self, f"mask of shape {mask.shape} is not {input_ids.shape}")
            mask_index = np.count_nonzero(mask == 1, axis=1).astype(np.int32)
        else:
            mask_index = np.zeros(batch, np.int32)
        return y, mask_index, total


declare_defaults(MS_DOMAIN, "EmbedLayerNormalization", {"epsilon": 1e-12, "mask_index_type": 1})


# --------------------------------------------------------------------------------------------------
# Attention family: masks and caches become the additive bias of the ONNX Attention kernel
# --------------------------------------------------------------------------------------------------
def _core(op: Op, *, scale: float | None, past: bool, softcap: float = 0.0, q_heads: int | None = None,
          kv_heads: int | None = None) -> Op:
    """The ONNX Attention kernel (opset 23) that computes ``op``'s scores, softmax and products."""
    attrs: dict[str, Any] = {}
    if scale is not None:
        attrs["scale"] = float(scale)
    if softcap:
        attrs["softcap"] = float(softcap)
    if q_heads is not None:
        attrs["q_num_heads"], attrs["kv_num_heads"] = int(q_heads), int(kv_heads or q_heads)
    inputs = ["q", "k", "v", "mask", "past_key" if past else "", "past_value" if past else ""]
    return _inner(op, "Attention", attrs, inputs=inputs, outputs=("y", "present_key", "present_value"))


def _heads(op: Op, x: np.ndarray, heads: int, what: str) -> np.ndarray:
    """(B, L, heads·D) → (B, heads, L, D)."""
    if x.ndim != 3 or x.shape[2] % heads:
        raise op_error(op, f"{what} of shape {x.shape} is not (batch, length, {heads} heads × head size)")
    b, length, hidden = x.shape
    return x.reshape(b, length, heads, hidden // heads).transpose(0, 2, 1, 3)


def _merge(y: np.ndarray) -> np.ndarray:
    """(B, N, S, D) → (B, S, N·D)."""
    b, n, s, d = y.shape
    return y.transpose(0, 2, 1, 3).reshape(b, s, n * d)


def _key_mask(op: Op, mask: np.ndarray, batch: int, q_len: int, total: int, past: int) -> np.ndarray:
    """The keys masked out by an ORT mask / mask_index, as a bool (B, 1, S, T) array (True: masked).

    Forms (ORT's Attention and MultiHeadAttention): (B) key lengths (right padding); (2B) exclusive
    ends then inclusive starts (left padding); (B, T) and (B, S, T) with 0 for masked; (B, 1, M, M)
    (Megatron GPT-2: rows ``past .. past+S`` and the first ``T`` columns are used; ORT runs this
    form on CUDA only, so here it follows the documentation alone)."""
    keys = np.arange(total)
    if mask.ndim == 1 and mask.shape[0] in (batch, 2 * batch):
        ends = mask[:batch].astype(np.int64).reshape(batch, 1, 1, 1)
        masked = keys >= ends
        if mask.shape[0] == 2 * batch:
            masked = masked | (keys < mask[batch:].astype(np.int64).reshape(batch, 1, 1, 1))
        return np.broadcast_to(masked, (batch, 1, q_len, total))
    if mask.ndim == 2 and mask.shape == (batch, total):
        return np.broadcast_to((mask == 0)[:, None, None, :], (batch, 1, q_len, total))
    if mask.ndim == 3 and mask.shape == (batch, q_len, total):
        return (mask == 0)[:, None]
    if mask.ndim == 4 and mask.shape[0] == batch and mask.shape[1] == 1 and mask.shape[2] >= past + q_len \
            and mask.shape[3] >= total:
        return (mask[:, :, past:past + q_len, :total] == 0)
    raise op_error(op, f"mask of shape {mask.shape} is none of the forms ({batch},), ({2 * batch},), "
                       f"({batch}, {total}), ({batch}, {q_len}, {total}), ({batch}, 1, max, max)")


def _causal(q_len: int, total: int, past: int) -> np.ndarray:
    """(1, 1, S, T) True where key j comes after query i (at absolute position ``past + i``)."""
    return (np.arange(total)[None, :] > past + np.arange(q_len)[:, None])[None, None]


def _additive(masked: np.ndarray | None, fill: float, attention_bias: np.ndarray | None,
              dtype: np.dtype) -> np.ndarray | None:
    """``fill`` where ``masked``, 0 elsewhere, plus ``attention_bias`` (ORT assigns the mask value
    to masked scores' bias before adding the attention bias)."""
    bias = None if masked is None else np.where(masked, dtype.type(fill), dtype.type(0))
    if attention_bias is not None:
        ab = attention_bias.astype(dtype, copy=False)
        bias = ab if bias is None else bias + ab
    return bias


def _check_bias(op: Op, attention_bias: np.ndarray | None, batch: int, heads: int, q_len: int, total: int) -> None:
    if attention_bias is None:
        return
    shape = attention_bias.shape
    if len(shape) != 4 or shape[0] not in (1, batch) or shape[1] not in (1, heads) or shape[2:] != (q_len, total):
        raise op_error(op, f"attention_bias of shape {shape} is not (1|{batch}, 1|{heads}, {q_len}, {total})")


@register("Attention", versions=(1,), domain=MS_DOMAIN)
class Attention(Op):
    """BERT/GPT-2 self-attention with the Q/K/V projections packed in one weight.

    ``Q|K|V = input @ weights + bias`` split by ``qkv_hidden_sizes`` (default three equal parts),
    ``num_heads`` heads; scores ``scale · QKᵀ`` (scale default 1/sqrt(Q head size)); masked keys
    get ``mask_filter_value`` (default -10000) as their additive bias, as ORT does, so a fully
    masked row is the softmax of its raw scores, not NaN; ``attention_bias`` is added; softmax;
    times V. ``mask_index``: see `_key_mask` (not the (3B+2) packed form of ORT's CUDA kernels).
    ``unidirectional`` masks keys after each query (queries sit after the ``past`` ones).
    ``past`` (2, B, N, P, H) is prepended to K/V; ``present`` is (2, B, N, P+L, H).
    Not supported: ``past_present_share_buffer`` / ``past_sequence_length``, ``do_rotary``.
    """

    multithreaded = True

    def check(self) -> None:
        if int(self.attr("do_rotary", 0)):
            self.unsupported("do_rotary=1")
        if int(self.attr("past_present_share_buffer", 0)) or _given(self, 6):
            self.unsupported("past_present_share_buffer (past_sequence_length)")
        self.heads = int(self.attr("num_heads"))
        if self.heads < 1:
            self.unsupported(f"num_heads={self.heads}")
        sizes = self.attr("qkv_hidden_sizes", None)
        self.sizes = None if sizes is None else [int(v) for v in sizes]
        if self.sizes is not None and (len(self.sizes) != 3 or self.sizes[0] != self.sizes[1]
                                       or any(v <= 0 or v % self.heads for v in self.sizes)):
            self.unsupported(f"qkv_hidden_sizes={self.sizes} (three sizes, Q and K equal, multiples of num_heads)")
        self.core = _core(self, scale=self.attr("scale", None), past=_given(self, 4))

    def run(self, x: np.ndarray, weights: np.ndarray, bias: np.ndarray | None = None,
            mask_index: np.ndarray | None = None, past: np.ndarray | None = None,
            attention_bias: np.ndarray | None = None, past_sequence_length: np.ndarray | None = None,
            ) -> tuple[np.ndarray, np.ndarray | None]:
        if x.ndim != 3 or weights.ndim != 2 or weights.shape[0] != x.shape[2]:
            raise op_error(self, f"input {x.shape} and weights {weights.shape} are not (B, S, D) and (D, QKV)")
        sizes = self.sizes or [weights.shape[1] // 3] * 3
        if sum(sizes) != weights.shape[1] or (bias is not None and bias.shape != (weights.shape[1],)):
            raise op_error(self, f"weights {weights.shape} / bias {None if bias is None else bias.shape} do not "
                                 f"hold Q, K and V of sizes {sizes}")
        work, out_dtype = gemm_dtypes(x, weights)
        qkv = matmul(x.astype(work, copy=False), weights.astype(work, copy=False))
        if bias is not None:
            qkv += bias.astype(work, copy=False)
        q, k, v = np.split(qkv, np.cumsum(sizes)[:2], axis=2)
        n = self.heads
        q4, k4, v4 = _heads(self, q, n, "Q"), _heads(self, k, n, "K"), _heads(self, v, n, "V")
        batch, q_len = x.shape[:2]
        past_k = past_v = None
        past_len = 0
        if past is not None:
            if past.ndim != 5 or past.shape[:3] != (2, batch, n) or past.shape[4] != k4.shape[3] \
                    or k4.shape[3] != v4.shape[3]:
                raise op_error(self, f"past of shape {past.shape} is not (2, {batch}, {n}, past, {k4.shape[3]})")
            past_k, past_v = past[0].astype(work, copy=False), past[1].astype(work, copy=False)
            past_len = past.shape[3]
        total = past_len + q_len
        masked = None
        if mask_index is not None:
            masked = _key_mask(self, mask_index, batch, q_len, total, past_len)
        if int(self.attr("unidirectional")):
            causal = _causal(q_len, total, past_len)
            masked = causal if masked is None else masked | causal
        _check_bias(self, attention_bias, batch, n, q_len, total)
        fill = float(self.attr("mask_filter_value"))
        y, present_k, present_v = self.core.run(q4, k4, v4, _additive(masked, fill, attention_bias, work),
                                                past_k, past_v)[:3]
        present = np.stack([present_k, present_v]).astype(out_dtype, copy=False) if _wanted(self, 1) else None
        return _merge(y).astype(out_dtype, copy=False), present


declare_defaults(MS_DOMAIN, "Attention", {"unidirectional": 0, "mask_filter_value": -10000.0, "do_rotary": 0,
                                          "past_present_share_buffer": 0})


@register("MultiHeadAttention", versions=(1,), domain=MS_DOMAIN)
class MultiHeadAttention(Op):
    """Self or cross attention on projected Q/K/V.

    Forms of the inputs: Q (B, S, D) with K (B, L, D) and V (B, L, Dv); packed K/V (B, L, N, 2, H)
    as ``key`` with no ``value``; packed Q/K/V (B, S, N, 3, H) as ``query`` alone; or K and V
    already split into heads (B, N, L, H) — cross attention's cached keys, which take no bias.
    ``bias`` (D + D + Dv) is added to Q and to 3-D K/V. ``key_padding_mask``: (B) lengths, (B, T)
    or (B, S, T) with 0 for masked (masked scores get ``mask_filter_value``, as in `Attention`).
    ``attention_bias`` (B|1, N|1, S, T) is added; ``past_key``/``past_value`` (B, N, P, H) are
    prepended and returned as ``present_key``/``present_value``; ``unidirectional`` is causal.
    Not supported: ``past_sequence_length`` and ``cache_indirection`` (ORT's decoder-masked
    beam search buffers), the ``qk`` output, and the (3B+2) packed mask of ORT's CUDA kernels.
    """

    multithreaded = True

    def check(self) -> None:
        if _given(self, 8) or _given(self, 9):
            self.unsupported("past_sequence_length / cache_indirection (shared KV buffers)")
        if _wanted(self, 3):
            self.unsupported("the qk output")
        if _given(self, 6) != _given(self, 7):
            self.unsupported("past_key without past_value (or the reverse)")
        self.heads = int(self.attr("num_heads"))
        if self.heads < 1:
            self.unsupported(f"num_heads={self.heads}")
        self.core = _core(self, scale=self.attr("scale", None), past=_given(self, 6))

    def _qkv(self, query: np.ndarray, key: np.ndarray | None, value: np.ndarray | None,
             bias: np.ndarray | None, work: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Q, K, V split into heads (B, N, ·, H), biased, in ``work``."""
        n = self.heads
        query = query.astype(work, copy=False)
        if key is None and value is None:  # packed QKV (B, S, N, 3, H)
            if query.ndim != 5 or query.shape[2:4] != (n, 3):
                raise op_error(self, f"query alone must be packed Q/K/V (B, S, {n}, 3, H), got {query.shape}")
            q, k, v = (query[:, :, :, i].transpose(0, 2, 1, 3) for i in range(3))
            if bias is not None:
                b = bias.astype(work, copy=False).reshape(3, n, 1, -1)
                q, k, v = q + b[0], k + b[1], v + b[2]
            return q, k, v
        if key is None:
            raise op_error(self, "value is given without key")
        q3 = query
        d = q3.shape[-1] if q3.ndim == 3 else -1
        if key.ndim == 5:  # packed KV (B, L, N, 2, H)
            if value is not None or key.shape[2:4] != (n, 2):
                raise op_error(self, f"packed key/value must be (B, L, {n}, 2, H) with no value input, got {key.shape}")
            k = key[:, :, :, 0].astype(work).transpose(0, 2, 1, 3)
            v = key[:, :, :, 1].astype(work).transpose(0, 2, 1, 3)
            kv_bias = True
        elif key.ndim == 4:  # already in heads (B, N, L, H): cross attention's cache
            if value is None or value.ndim != 4 or key.shape[1] != n or value.shape[:3] != key.shape[:3]:
                raise op_error(self, f"key {key.shape} / value {None if value is None else value.shape} in heads "
                                     f"must both be (B, {n}, L, H)")
            k, v = key.astype(work, copy=False), value.astype(work, copy=False)
            kv_bias = False
        else:
            if value is None:
                raise op_error(self, "key is 3-D but value is missing")
            k, v = _heads(self, key.astype(work, copy=False), n, "key"), _heads(self, value.astype(work, copy=False),
                                                                               n, "value")
            kv_bias = True
        q = _heads(self, q3, n, "query")
        if bias is not None:
            b = bias.astype(work, copy=False)
            dk, dv = k.shape[1] * k.shape[3], v.shape[1] * v.shape[3]
            if b.shape != (d + dk + dv,):
                raise op_error(self, f"bias of shape {bias.shape} is not ({d} + {dk} + {dv},)")
            q = q + b[:d].reshape(n, 1, -1)
            if kv_bias:
                k = k + b[d:d + dk].reshape(n, 1, -1)
                v = v + b[d + dk:].reshape(n, 1, -1)
        return q, k, v

    def run(self, query: np.ndarray, key: np.ndarray | None = None, value: np.ndarray | None = None,
            bias: np.ndarray | None = None, key_padding_mask: np.ndarray | None = None,
            attention_bias: np.ndarray | None = None, past_key: np.ndarray | None = None,
            past_value: np.ndarray | None = None, *_: np.ndarray | None) -> tuple[np.ndarray | None, ...]:
        work, out_dtype = compute_dtype(query.dtype), query.dtype
        q, k, v = self._qkv(query, key, value, bias, work)
        batch, n, q_len = q.shape[:3]
        past_len = 0
        if past_key is not None and past_value is not None:
            if past_key.ndim != 4 or past_key.shape[:2] != (batch, n) or past_key.shape[3] != k.shape[3] \
                    or past_value.shape[:3] != past_key.shape[:3]:
                raise op_error(self, f"past_key {past_key.shape} / past_value {past_value.shape} are not "
                                     f"({batch}, {n}, past, {k.shape[3]})")
            past_len = past_key.shape[2]
            past_key, past_value = past_key.astype(work, copy=False), past_value.astype(work, copy=False)
        total = past_len + k.shape[2]
        masked = None
        if key_padding_mask is not None:
            masked = _key_mask(self, key_padding_mask, batch, q_len, total, past_len)
        if int(self.attr("unidirectional")):
            causal = _causal(q_len, total, total - q_len)
            masked = causal if masked is None else masked | causal
        _check_bias(self, attention_bias, batch, n, q_len, total)
        fill = float(self.attr("mask_filter_value"))
        y, present_k, present_v = self.core.run(q, k, v, _additive(masked, fill, attention_bias, work),
                                                past_key, past_value)[:3]
        present_k = present_k.astype(out_dtype, copy=False) if _wanted(self, 1) else None
        present_v = present_v.astype(out_dtype, copy=False) if _wanted(self, 2) else None
        return _merge(y).astype(out_dtype, copy=False), present_k, present_v, None


declare_defaults(MS_DOMAIN, "MultiHeadAttention", {"unidirectional": 0, "mask_filter_value": -10000.0})


@register("RotaryEmbedding", versions=(1,), domain=MS_DOMAIN)
class RotaryEmbedding(Op):
    """Rotary position embedding (the ONNX ``RotaryEmbedding`` kernel), ORT's input order
    ``(input, position_ids, cos_cache, sin_cache)``.

    ``input`` is (B, S, N·H) or (B, N, S, H). ``position_ids`` is (B, S), or (1,) holding the
    position of the first token (then ``p0 + 0..S-1`` for every batch row). The rotated width is
    ``rotary_embedding_dim``, else ``2 · cos_cache.shape[1]``; for 3-D input the head count is
    ``num_heads``, else hidden / head size with the head size the rotated width (as ORT infers it).
    ``interleaved`` pairs adjacent features instead of the two halves. ``scale`` is not read by
    ORT's kernels and is ignored here too. Not supported: ``is_packed_batching``.
    """

    def check(self) -> None:
        if int(self.attr("is_packed_batching")):
            self.unsupported("is_packed_batching=1")
        self.rot = int(self.attr("rotary_embedding_dim"))
        self.num_heads = int(self.attr("num_heads"))
        if self.rot and not self.num_heads:
            self.unsupported("rotary_embedding_dim without num_heads")
        self.rope = _inner(self, "RotaryEmbedding", {"interleaved": int(self.attr("interleaved")),
                                                     "rotary_embedding_dim": self.rot},
                           inputs=("x", "cos", "sin", "position_ids"))

    def run(self, x: np.ndarray, position_ids: np.ndarray, cos_cache: np.ndarray, sin_cache: np.ndarray) -> np.ndarray:
        if x.ndim not in (3, 4):
            raise op_error(self, f"input must be 3-D or 4-D, got shape {x.shape}")
        batch, seq = x.shape[0], x.shape[1] if x.ndim == 3 else x.shape[2]
        positions = _positions(self, position_ids, batch, seq, cos_cache.shape[0])
        if x.ndim == 4:
            return self.rope.run(x, cos_cache, sin_cache, positions)
        head = self.num_heads and x.shape[2] // self.num_heads or 2 * cos_cache.shape[1]
        if not head or x.shape[2] % head:
            raise op_error(self, f"hidden size {x.shape[2]} is not a multiple of the head size {head}")
        x4 = x.reshape(batch, seq, x.shape[2] // head, head).transpose(0, 2, 1, 3)
        y4 = self.rope.run(x4, cos_cache, sin_cache, positions)
        return y4.transpose(0, 2, 1, 3).reshape(x.shape)


def _positions(op: Op, position_ids: np.ndarray, batch: int, seq: int, cache_rows: int) -> np.ndarray:
    """(B, S) int64 positions from ORT's position_ids forms, each checked against the cache."""
    ids = np.asarray(position_ids).astype(np.int64)
    if ids.shape in ((1,), ()):
        ids = np.broadcast_to(ids.reshape(1, 1) + np.arange(seq), (batch, seq))
    elif ids.shape == (1, seq):
        ids = np.broadcast_to(ids, (batch, seq))
    elif ids.shape != (batch, seq):
        raise op_error(op, f"position_ids of shape {position_ids.shape} is not ({batch}, {seq}) nor (1,)")
    if ids.size and (ids.min() < 0 or ids.max() >= cache_rows):
        raise op_error(op, f"positions [{ids.min()}, {ids.max()}] fall outside the {cache_rows} rows of the "
                           "cos/sin caches")
    return ids


declare_defaults(MS_DOMAIN, "RotaryEmbedding", {"interleaved": 0, "is_packed_batching": 0, "num_heads": 0,
                                                "rotary_embedding_dim": 0, "scale": 1.0})


@register("GroupQueryAttention", versions=(1,), domain=MS_DOMAIN)
class GroupQueryAttention(Op):
    """Grouped-query attention with a KV cache, as ORT's CPU kernel computes it.

    ``query`` (B, S, N·H) with ``key``/``value`` (B, S, Nkv·H), or packed (B, S, (N+2Nkv)·H) alone.
    ``seqlens_k`` (B) holds each row's total length minus one; ``total_sequence_length`` the batch
    maximum. When S equals that maximum this is the first prompt: no past is read, and row ``b``'s
    new tokens sit at positions ``0..S-1`` (keys past its own length are padding). Otherwise row
    ``b``'s past holds ``seqlens_k[b] + 1 - S`` valid tokens and the new ones follow them.
    ``present_key``/``present_value`` (B, Nkv, max(P, T), H) hold the valid past, then the new K/V;
    rows after a row's length are zero. Each query sees the keys at or before its position
    (``causal``, default 1), only the ``local_window_size`` most recent of them (its own included,
    as ORT's CPU kernel counts) when that is positive, and never a row's padding. ``do_rotary`` rotates Q and the new K with ``cos_cache``/``sin_cache``
    at those positions (or ``position_ids``), ``rotary_interleaved`` as in `RotaryEmbedding`.
    ``attention_bias`` is added, ``softcap`` caps the scores, ``head_sink`` (or ``smooth_softmax``,
    a sink of 0) adds one more logit to each softmax's denominator.

    Not supported (refused at worker creation): quantized KV caches (``k_quant_type`` …),
    ``q_norm_weight``/``k_norm_weight``, ``query_seqlens``, ``sliding_window_cache``, and the
    ``output_qk`` output.
    """

    multithreaded = True

    def check(self) -> None:
        self.heads, self.kv_heads = int(self.attr("num_heads")), int(self.attr("kv_num_heads"))
        if self.heads < 1 or self.kv_heads < 1 or self.heads % self.kv_heads:
            self.unsupported(f"num_heads={self.heads} with kv_num_heads={self.kv_heads}")
        for name in ("k_quant_type", "v_quant_type"):
            if str(self.attr(name)).upper() != "NONE":
                self.unsupported(f"{name}={self.attr(name)!r} (quantized KV cache)")
        if int(self.attr("sliding_window_cache")):
            self.unsupported("sliding_window_cache=1")
        if any(_given(self, i) for i in (12, 13, 14, 15, 16)):
            self.unsupported("k_scale / v_scale / q_norm_weight / k_norm_weight / query_seqlens")
        if _wanted(self, 3) or int(self.attr("qk_output")):
            self.unsupported("the output_qk output")
        if _given(self, 3) != _given(self, 4):
            self.unsupported("past_key without past_value (or the reverse)")
        self.causal = bool(int(self.attr("causal")))
        self.window = int(self.attr("local_window_size"))
        self.rotary = bool(int(self.attr("do_rotary")))
        if self.rotary and not (_given(self, 7) and _given(self, 8)):
            self.unsupported("do_rotary=1 without cos_cache and sin_cache")
        self.sink = _given(self, 11) or int(self.attr("smooth_softmax")) == 1
        self.core = _core(self, scale=self.attr("scale", None), past=False,
                          softcap=float(self.attr("softcap")))
        if self.rotary:
            self.rope = _inner(self, "RotaryEmbedding", {"interleaved": int(self.attr("rotary_interleaved"))},
                               inputs=("x", "cos", "sin", "position_ids"))

    def _split(self, query: np.ndarray, key: np.ndarray | None, value: np.ndarray | None,
               work: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n, nkv = self.heads, self.kv_heads
        if query.ndim != 3:
            raise op_error(self, f"query must be 3-D (batch, sequence, hidden), got shape {query.shape}")
        query = query.astype(work, copy=False)
        if key is None and value is None:
            width = query.shape[2]
            if width % (n + 2 * nkv):
                raise op_error(self, f"packed Q/K/V width {width} is not a multiple of {n} + 2×{nkv} heads")
            h = width // (n + 2 * nkv)
            query, key, value = np.split(query, [n * h, (n + nkv) * h], axis=2)
        elif key is None or value is None:
            raise op_error(self, "key and value go together (or neither, for packed Q/K/V)")
        q, k, v = (_heads(self, query, n, "query"), _heads(self, key.astype(work, copy=False), nkv, "key"),
                   _heads(self, value.astype(work, copy=False), nkv, "value"))
        if k.shape[3] != q.shape[3] or v.shape[3] != q.shape[3] or k.shape[2] != q.shape[2] \
                or v.shape[:3] != k.shape[:3]:
            raise op_error(self, f"query {query.shape}, key {key.shape}, value {value.shape} do not share the "
                                 f"batch, sequence and head size")
        return q, k, v

    def run(self, query: np.ndarray, key: np.ndarray | None, value: np.ndarray | None,
            past_key: np.ndarray | None, past_value: np.ndarray | None, seqlens_k: np.ndarray,
            total_sequence_length: np.ndarray, cos_cache: np.ndarray | None = None,
            sin_cache: np.ndarray | None = None, position_ids: np.ndarray | None = None,
            attention_bias: np.ndarray | None = None, head_sink: np.ndarray | None = None,
            *_: np.ndarray | None) -> tuple[np.ndarray | None, ...]:
        work, out_dtype = compute_dtype(query.dtype), query.dtype
        q, k, v = self._split(query, key, value, work)
        batch, _, seq, head = q.shape
        nkv = self.kv_heads
        lengths = np.asarray(seqlens_k).astype(np.int64).reshape(-1) + 1
        total = int(np.asarray(total_sequence_length).reshape(-1)[0])
        if lengths.shape != (batch,) or lengths.min() < 1 or lengths.max() > total:
            raise op_error(self, f"seqlens_k {np.asarray(seqlens_k).tolist()} does not hold {batch} lengths - 1 "
                                 f"within total_sequence_length {total}")
        first_prompt = seq == total
        past_len = np.zeros(batch, np.int64) if first_prompt else lengths - seq
        if past_len.min() < 0:
            raise op_error(self, f"seqlens_k {(lengths - 1).tolist()} leaves no room for {seq} new tokens")
        capacity = 0 if past_key is None else past_key.shape[2]
        if past_key is not None:
            if past_key.shape[:2] != (batch, nkv) or past_key.shape[3] != head or past_value.shape != past_key.shape:
                raise op_error(self, f"past_key {past_key.shape} / past_value {past_value.shape} are not "
                                     f"({batch}, {nkv}, past, {head})")
            if not first_prompt and past_len.max() > capacity:
                raise op_error(self, f"past of length {capacity} cannot hold {past_len.max()} past tokens")
        slots = max(capacity, total)
        pos = past_len[:, None] + np.arange(seq)  # (B, S): absolute positions of the new tokens
        if self.rotary:
            rope_pos = _positions(self, pos if position_ids is None else position_ids, batch, seq,
                                  cos_cache.shape[0])
            q = self.rope.run(q, cos_cache, sin_cache, rope_pos)
            k = self.rope.run(k, cos_cache, sin_cache, rope_pos)
        present_k = np.zeros((batch, nkv, slots, head), work)
        present_v = np.zeros((batch, nkv, slots, head), work)
        rows = np.arange(batch)[:, None]
        if past_key is not None and not first_prompt:
            keep = np.arange(capacity)[None, :] < past_len[:, None]  # (B, P): valid past tokens
            present_k[:, :, :capacity] = np.where(keep[:, None, :, None], past_key.astype(work), 0)
            present_v[:, :, :capacity] = np.where(keep[:, None, :, None], past_value.astype(work), 0)
        present_k.transpose(0, 2, 1, 3)[rows, pos] = k.transpose(0, 2, 1, 3)
        present_v.transpose(0, 2, 1, 3)[rows, pos] = v.transpose(0, 2, 1, 3)
        # keys each query may see: the row's valid keys, not after the query (causal), within the window
        keys = np.arange(slots)
        allowed = keys[None, None, :] < lengths[:, None, None]  # (B, S, T)
        if self.causal:
            allowed = allowed & (keys[None, None, :] <= pos[:, :, None])
        if self.window > 0:  # the window holds the query's own position and the ones before it
            allowed = allowed & (keys[None, None, :] > pos[:, :, None] - self.window)
        bias = np.where(allowed, work.type(0), work.type(-np.inf))[:, None]  # (B, 1, S, T)
        if attention_bias is not None:
            _check_bias(self, attention_bias, batch, self.heads, seq, attention_bias.shape[-1])
            width = min(attention_bias.shape[-1], slots)
            bias = np.broadcast_to(bias, (batch, attention_bias.shape[1], seq, slots)).copy()
            bias[..., :width] += attention_bias[..., :width].astype(work, copy=False)
        k_all, v_all = present_k, present_v
        if self.sink:  # one more key scoring exactly the sink logit (q·0 + bias), with a zero value
            sinks = (np.zeros(self.heads, work) if head_sink is None
                     else np.asarray(head_sink, dtype=work).reshape(self.heads))
            zeros = np.zeros((batch, nkv, 1, head), work)
            k_all, v_all = np.concatenate([k_all, zeros], axis=2), np.concatenate([v_all, zeros], axis=2)
            bias = np.broadcast_to(bias, (batch, self.heads, seq, slots))
            column = np.broadcast_to(sinks.reshape(1, self.heads, 1, 1), (batch, self.heads, seq, 1))
            bias = np.concatenate([bias, column], axis=3)
        y = self.core.run(q, k_all, v_all, bias)[0]
        return (_merge(y).astype(out_dtype, copy=False),
                present_k.astype(out_dtype, copy=False) if _wanted(self, 1) else None,
                present_v.astype(out_dtype, copy=False) if _wanted(self, 2) else None, None)


declare_defaults(MS_DOMAIN, "GroupQueryAttention", {
    "causal": 1, "do_rotary": 0, "k_quant_type": "NONE", "v_quant_type": "NONE", "kv_cache_bit_width": 0,
    "local_window_size": -1, "qk_output": 0, "rotary_interleaved": 0, "sliding_window_cache": 0,
    "smooth_softmax": -1, "softcap": 0.0})

# Attribute defaults of the other ops, from ORT's schemas (FusedConv's geometry: Conv's).
declare_defaults(MS_DOMAIN, "QuickGelu", {"alpha": 1.702})
declare_defaults(MS_DOMAIN, "FusedMatMul", {"alpha": 1.0, "transA": 0, "transB": 0, "transBatchA": 0,
                                            "transBatchB": 0})
declare_defaults(MS_DOMAIN, "FusedGemm", {"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 0})
declare_defaults(MS_DOMAIN, "FusedConv", {"group": 1, "auto_pad": "NOTSET"})

__all__ = ["Attention", "BiasAdd", "BiasGelu", "BiasSplitGelu", "EmbedLayerNormalization", "FastGelu",
           "FusedConv", "FusedGemm", "FusedMatMul", "Gelu", "GroupQueryAttention", "MultiHeadAttention",
           "QuickGelu", "RotaryEmbedding", "SimplifiedLayerNormalization", "SkipLayerNormalization",
           "SkipSimplifiedLayerNormalization"]
