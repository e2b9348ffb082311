"""Attention-family ops: Attention, FlexAttention, LinearAttention, RotaryEmbedding, TensorScatter,
CausalConvWithState, SwiGLU and Swish.

Precision: narrow floats (float16, bfloat16) are computed in float32, but wherever the ONNX
definition produces an intermediate tensor of the input type (the scaled Q and K, the QK^T matmul,
the masked scores, the softmax, ...) the value is rounded to that type, so results match a runtime
that stores those intermediates in float16/bfloat16. Softmax "in precision P" likewise rounds its
exponentials and their sum to P.

Grouped-query attention (fewer K/V heads than Q heads) never copies K or V: the query heads that
share a K/V head are stacked into one GEMM against it.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from onnx import TensorProto

from ..dtypes import onnx_to_numpy
from .pointwise import sigmoid
from .base import Op
from .controlflow import Subgraph
from .elementwise import compute_dtype, float_kernel
from .registry import register
from .shape import normalize_axis, op_error

_SOFTMAX_PRECISIONS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------
def _round(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``x`` cast to ``dtype``, held in ``dtype``'s compute dtype (float32 for narrow floats): the
    value a runtime storing the intermediate in ``dtype`` would see."""
    dtype = np.dtype(dtype)
    cd = compute_dtype(dtype)
    if cd == dtype or x.dtype == dtype:
        return x.astype(cd, copy=False)
    return x.astype(dtype).astype(cd)


def _groups(op: Op, q_heads: int, kv_heads: int) -> int:
    """Query heads per K/V head; ONNX requires the Q head count to be a multiple of the K/V one."""
    if kv_heads == 0 or q_heads % kv_heads:
        raise op_error(op, f"{q_heads} query heads are not a multiple of {kv_heads} key/value heads")
    return q_heads // kv_heads


def _grouped_matmul(op: Op, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` where ``a`` is ``(B, Hq, M, K)`` and ``b`` is ``(B, Hkv, K, N)``: query head h uses
    K/V head ``h // (Hq / Hkv)``. The heads sharing a K/V head are adjacent, so their rows stack
    into one taller GEMM per K/V head: no copy of ``b`` and fewer, larger BLAS calls."""
    batch, q_heads, m, _ = a.shape
    kv_heads = b.shape[1]
    g = _groups(op, q_heads, kv_heads)
    out = np.matmul(a.reshape(batch, kv_heads, g * m, a.shape[-1]), b)
    return out.reshape(batch, q_heads, m, b.shape[-1])


def _softmax_in(x: np.ndarray, dtype: np.dtype, guard: np.ndarray | None = None) -> np.ndarray:
    """Softmax over the last axis of ``x`` (values of ``dtype``, held in its compute dtype) evaluated
    "in ``dtype``": the exponentials, their sum and the quotients are rounded to ``dtype``. Rows
    where ``guard`` is True (fully masked) are zero, not NaN."""
    with np.errstate(all="ignore"):
        peak = np.max(x, axis=-1, keepdims=True)
        peak = np.where(np.isfinite(peak), peak, 0)  # an all -inf row must not give (-inf) - (-inf)
        e = _round(np.exp(x - peak), dtype)
        p = _round(e / _round(np.sum(e, axis=-1, keepdims=True), dtype), dtype)
    if guard is not None:
        p = np.where(guard, p.dtype.type(0), p)
    return p


def _scaled(x: np.ndarray, root_scale: float, dtype: np.dtype) -> np.ndarray:
    """``x * sqrt(scale)`` in ``dtype``'s precision (Q and K are scaled before QK^T, per ONNX)."""
    cd = compute_dtype(dtype)
    factor = _round(np.asarray(root_scale, dtype=cd), dtype)
    return _round(x.astype(cd, copy=False) * factor, dtype)


def _scores(op: Op, q: np.ndarray, k: np.ndarray, scale: float | None) -> np.ndarray:
    """``(Q sqrt(s)) @ (K sqrt(s))^T`` for 4-D Q/K, in Q's precision (held in its compute dtype);
    ``s`` defaults to 1/sqrt(head size). Scaling both sides first keeps the products in range."""
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    root = math.sqrt(s) if s >= 0 else float("nan")
    qs, ks = _scaled(q, root, q.dtype), _scaled(k, root, q.dtype)
    return _round(_grouped_matmul(op, qs, np.swapaxes(ks, -1, -2)), q.dtype)


def _to_heads(op: Op, x: np.ndarray, heads: int | None, what: str) -> np.ndarray:
    """A 3-D ``(B, S, heads*D)`` tensor as 4-D ``(B, heads, S, D)``; 4-D tensors pass through."""
    if x.ndim == 4:
        return x
    if x.ndim != 3:
        raise op_error(op, f"{what} must be 3-D or 4-D, got shape {x.shape}")
    if not heads or x.shape[2] % heads:
        raise op_error(op, f"3-D {what} of hidden size {x.shape[2]} needs a head-count attribute dividing it "
                           f"(got {heads})")
    b, s, hidden = x.shape
    return x.reshape(b, s, heads, hidden // heads).transpose(0, 2, 1, 3)


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------
@register("Attention", versions=(23, 24, 25))
class Attention(Op):
    """Scaled dot-product attention (MHA/GQA/MQA) with masks, causal/windowed masking, KV cache,
    softcap and the optional QK output. Version 24 adds ``nonpad_kv_seqlen``, 25 the local windows."""

    multithreaded = True  # two batched GEMMs

    def check(self) -> None:
        mode = int(self.attr("qk_matmul_output_mode"))
        if mode not in (0, 1, 2, 3):
            self.unsupported(f"qk_matmul_output_mode={mode}")
        precision = self.attr("softmax_precision", None)
        if precision is not None and int(precision) not in _SOFTMAX_PRECISIONS:
            self.unsupported(f"softmax_precision={precision}")
        names = list(self.layer.inputs) + [""] * 7
        if bool(names[4]) != bool(names[5]):
            self.unsupported("past_key without past_value (or the reverse)")
        if names[6] and (names[4] or any(self.layer.outputs[1:3])):
            self.unsupported("nonpad_kv_seqlen together with past/present key and value")

    def run(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, attn_mask: np.ndarray | None = None,
            past_key: np.ndarray | None = None, past_value: np.ndarray | None = None,
            nonpad_kv_seqlen: np.ndarray | None = None) -> tuple[np.ndarray | None, ...]:
        t1 = q.dtype
        three_d = q.ndim == 3
        q_heads, kv_heads = self.attr("q_num_heads", None), self.attr("kv_num_heads", None)
        q4 = _to_heads(self, q, q_heads, "Q")
        k4 = _to_heads(self, k, kv_heads, "K")
        v4 = _to_heads(self, v, kv_heads, "V")
        past_len = 0
        if past_key is not None and past_value is not None:
            past_len = past_key.shape[2]
            k4 = np.concatenate([past_key, k4.astype(past_key.dtype, copy=False)], axis=2)
            v4 = np.concatenate([past_value, v4.astype(past_value.dtype, copy=False)], axis=2)
        cd = compute_dtype(t1)
        wanted_qk = len(self.layer.outputs) > 3 and bool(self.layer.outputs[3])
        mode = int(self.attr("qk_matmul_output_mode"))
        with np.errstate(all="ignore"):
            scores = _scores(self, q4, k4.astype(t1, copy=False), self.attr("scale", None))
            qk = scores if mode == 0 else None
            softcap = float(self.attr("softcap"))
            if softcap > 0:  # softcap * tanh(scores / softcap), each step in T1
                cap = cd.type(softcap)
                scores = _round(cap * _round(np.tanh(_round(scores / cap, t1)), t1), t1)
            qk = scores if mode == 1 else qk
            bias = self._bias(attn_mask, q4.shape[2], k4.shape[2], past_len, nonpad_kv_seqlen, cd, t1)
            masked_rows = None
            if bias is not None:
                scores = _round(scores + bias, t1)
                masked_rows = np.all(bias == -np.inf, axis=-1, keepdims=True)
            qk = scores if mode == 2 else qk
            precision = self.attr("softmax_precision", None)
            p_dtype = t1 if precision is None else np.dtype(onnx_to_numpy(int(precision)))
            if p_dtype != t1:
                scores = _round(scores, p_dtype)
            probs = _softmax_in(scores, p_dtype, masked_rows)
            if p_dtype != t1:
                probs = _round(probs.astype(cd), t1)
            qk = probs if mode == 3 else qk
            y = _grouped_matmul(self, probs, v4.astype(cd, copy=False))
        if three_d:
            y = y.transpose(0, 2, 1, 3).reshape(y.shape[0], y.shape[2], -1)
        # present key/value: the past (if any) followed by this step's K/V, always 4-D
        return (y.astype(t1, copy=False), k4, v4,
                qk.astype(t1, copy=False) if wanted_qk and qk is not None else None)

    def _bias(self, attn_mask: np.ndarray | None, q_len: int, total: int, past_len: int,
              nonpad: np.ndarray | None, cd: np.dtype, t1: np.dtype) -> np.ndarray | None:
        """The additive bias (0 or -inf from the structural masks, plus the float mask), broadcastable
        to ``(B, Hq, L, S)``; None when nothing is masked."""
        causal = bool(int(self.attr("is_causal")))
        left, right = int(self.attr("left_window_size", -1)), int(self.attr("right_window_size", -1))
        bias = None
        if attn_mask is not None:
            if attn_mask.dtype == bool:
                bias = np.where(attn_mask, cd.type(0), cd.type(-np.inf))
            else:
                bias = _round(attn_mask.astype(cd, copy=False), t1)
            width = bias.shape[-1] if bias.ndim else 1
            if 1 < width < total:  # a shorter mask is padded with -inf (masked keys); 1 broadcasts
                pad = [(0, 0)] * (bias.ndim - 1) + [(0, total - bias.shape[-1])]
                bias = np.pad(bias, pad, constant_values=-np.inf)
            elif width not in (1, total):
                raise op_error(self, f"attn_mask's last dimension {width} exceeds the {total} keys")
        if not (causal or left >= 0 or right >= 0 or nonpad is not None):
            return bias
        keys = np.arange(total)
        # Absolute position of each query: after the cached keys (past, or the valid external cache).
        offset = np.asarray(past_len, dtype=np.int64).reshape(1, 1, 1, 1)
        if nonpad is not None:  # an external cache: the queries are its last valid positions
            lengths = nonpad.astype(np.int64).reshape(-1, 1, 1, 1)
            offset = lengths - q_len
        pos = offset + np.arange(q_len).reshape(1, 1, -1, 1)
        allowed = np.ones((1, 1, 1, total), dtype=bool)
        if causal:
            allowed = allowed & (keys <= pos)
        if left >= 0:
            allowed = allowed & (keys >= pos - left)
        if right >= 0:
            allowed = allowed & (keys <= pos + right)
        if nonpad is not None:
            allowed = allowed & (keys < lengths)
        structural = np.where(allowed, cd.type(0), cd.type(-np.inf))
        return structural if bias is None else bias + structural


# --------------------------------------------------------------------------------------------
# FlexAttention (ai.onnx.preview)
# --------------------------------------------------------------------------------------------
@register("FlexAttention", versions=(1,), domain="ai.onnx.preview")
class FlexAttention(Op):
    """Attention with optional ``score_mod``/``prob_mod`` subgraphs applied to the scores and the
    probabilities, which are in the softmax precision (float32, or float64 for double inputs)."""

    multithreaded = True

    def check(self) -> None:
        precision = self.attr("softmax_precision", None)
        if precision is not None and int(precision) not in _SOFTMAX_PRECISIONS:
            self.unsupported(f"softmax_precision={precision}")
        self.mods = {name: Subgraph(self, name) for name in ("score_mod", "prob_mod") if name in self.attrs}

    def _modify(self, name: str, x: np.ndarray, outer: dict[str, Any]) -> np.ndarray:
        mod = self.mods.get(name)
        if mod is None:
            return x
        (out,) = mod.run([x], outer)
        if np.shape(out) != x.shape:
            raise op_error(self, f"{name} changed the shape {x.shape} to {np.shape(out)}")
        return np.asarray(out).astype(x.dtype, copy=False)

    def run(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, *outer_values: np.ndarray) -> np.ndarray:
        for name, x in (("Q", q), ("K", k), ("V", v)):
            if x.ndim != 4:
                raise op_error(self, f"{name} must be 4-D, got shape {x.shape}")
        outer = dict(zip(self.layer.outer_inputs, outer_values))
        precision = self.attr("softmax_precision", None)
        if precision is None:
            p_dtype = np.dtype(np.float64 if q.dtype == np.float64 else np.float32)
        else:
            p_dtype = np.dtype(onnx_to_numpy(int(precision)))
        with np.errstate(all="ignore"):
            scores = _scores(self, q, k.astype(q.dtype, copy=False), self.attr("scale", None))
            scores = self._modify("score_mod", _round(scores, p_dtype).astype(p_dtype), outer)
            probs = self._modify("prob_mod", _softmax_in(scores.astype(compute_dtype(p_dtype)), p_dtype)
                                 .astype(p_dtype), outer)
            pc = compute_dtype(p_dtype)
            y = _grouped_matmul(self, probs.astype(pc, copy=False), _round(v.astype(pc, copy=False), p_dtype))
        return _round(y, p_dtype).astype(q.dtype)


# --------------------------------------------------------------------------------------------
# LinearAttention
# --------------------------------------------------------------------------------------------
_UPDATE_RULES = ("linear", "gated", "delta", "gated_delta")


@register("LinearAttention", versions=(27,))
class LinearAttention(Op):
    """The linear-attention recurrence, token by token (vectorised over batch and heads):
    ``S' = exp(g) * S`` for gated rules, then ``S = S' + k (x) u`` with ``u = v`` or, for delta rules,
    ``u = beta * (v - S'^T k)``; the output is ``scale * q^T S``."""

    def check(self) -> None:
        rule = self.attr("update_rule")
        if rule not in _UPDATE_RULES:
            self.unsupported(f"update_rule={rule!r}")
        q_heads, kv_heads = int(self.attr("q_num_heads")), int(self.attr("kv_num_heads"))
        if kv_heads <= 0 or q_heads <= 0 or q_heads % kv_heads:
            self.unsupported(f"q_num_heads={q_heads} with kv_num_heads={kv_heads}")
        names = list(self.layer.inputs) + [""] * 6
        if "gated" in rule and not names[4]:
            self.unsupported(f"update_rule={rule!r} without a decay input")
        if "delta" in rule and not names[5]:
            self.unsupported(f"update_rule={rule!r} without a beta input")

    def run(self, query: np.ndarray, key: np.ndarray, value: np.ndarray, past_state: np.ndarray | None = None,
            decay: np.ndarray | None = None, beta: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        rule = self.attr("update_rule")
        hq, hkv = int(self.attr("q_num_heads")), int(self.attr("kv_num_heads"))
        b, t = query.shape[:2]
        dk, dv = query.shape[2] // hq, value.shape[2] // hkv
        if query.shape[2] != hq * dk or key.shape[2] != hkv * dk or value.shape[2] != hkv * dv:
            raise op_error(self, f"query {query.shape}, key {key.shape} and value {value.shape} do not split "
                                 f"into {hq} query and {hkv} key/value heads of one head size")
        cd = compute_dtype(query.dtype)
        scale = float(self.attr("scale")) or 1.0 / math.sqrt(dk)
        q = query.astype(cd, copy=False).reshape(b, t, hkv, hq // hkv, dk)
        k = key.astype(cd, copy=False).reshape(b, t, hkv, dk)
        v = value.astype(cd, copy=False).reshape(b, t, hkv, dv)
        gates = None if "gated" not in rule else np.exp(decay.astype(cd, copy=False)).reshape(b, t, hkv, -1, 1)
        rates = None if "delta" not in rule else beta.astype(cd, copy=False).reshape(b, t, -1, 1)
        state_dtype = query.dtype if past_state is None else past_state.dtype
        state = (np.zeros((b, hkv, dk, dv), dtype=cd) if past_state is None
                 else past_state.astype(cd).reshape(b, hkv, dk, dv))
        out = np.empty((b, t, hkv, hq // hkv, dv), dtype=cd)
        with np.errstate(all="ignore"):
            for i in range(t):
                if gates is not None:
                    state = gates[:, i] * state
                update = v[:, i]
                if rates is not None:
                    update = rates[:, i] * (update - np.einsum("bhkv,bhk->bhv", state, k[:, i]))
                state = state + k[:, i, :, :, None] * update[:, :, None, :]
                out[:, i] = scale * np.einsum("bhgk,bhkv->bhgv", q[:, i], state)
        return out.reshape(b, t, hq * dv).astype(query.dtype), state.astype(state_dtype)


# --------------------------------------------------------------------------------------------
# RotaryEmbedding
# --------------------------------------------------------------------------------------------
@register("RotaryEmbedding", versions=(23,))
class RotaryEmbedding(Op):
    """Rotate the first ``rotary_embedding_dim`` features of each head by position-dependent angles:
    pairs are the two halves of that slice, or adjacent features when ``interleaved``."""

    def run(self, x: np.ndarray, cos_cache: np.ndarray, sin_cache: np.ndarray,
            position_ids: np.ndarray | None = None) -> np.ndarray:
        cd = compute_dtype(x.dtype)
        if x.ndim == 4:  # (B, H, S, D): angles (B, S, R/2) broadcast over heads
            data, head_axis = x.astype(cd), 1
        elif x.ndim == 3:  # (B, S, H*D) viewed as (B, S, H, D)
            heads = int(self.attr("num_heads", 0))
            if heads <= 0 or x.shape[2] % heads:
                raise op_error(self, f"3-D input of hidden size {x.shape[2]} needs num_heads dividing it")
            data, head_axis = x.astype(cd).reshape(x.shape[0], x.shape[1], heads, -1), 2
        else:
            raise op_error(self, f"input must be 3-D or 4-D, got shape {x.shape}")
        rot = int(self.attr("rotary_embedding_dim")) or data.shape[-1]
        half = rot // 2
        if position_ids is not None:
            cos_cache, sin_cache = cos_cache[position_ids], sin_cache[position_ids]
        if cos_cache.shape[-1] != half or sin_cache.shape[-1] != half or rot > data.shape[-1] or rot % 2:
            raise op_error(self, f"cos/sin caches of width {cos_cache.shape[-1]}/{sin_cache.shape[-1]} do not "
                                 f"match half the rotary dimension {rot} (head size {data.shape[-1]})")
        cos = np.expand_dims(cos_cache.astype(cd, copy=False), head_axis)
        sin = np.expand_dims(sin_cache.astype(cd, copy=False), head_axis)
        first, second = ((slice(0, rot, 2), slice(1, rot, 2)) if int(self.attr("interleaved"))
                         else (slice(0, half), slice(half, rot)))
        x1, x2 = data[..., first].copy(), data[..., second]
        data[..., first] = cos * x1 - sin * x2
        data[..., second] = sin * x1 + cos * x2
        return data.reshape(x.shape).astype(x.dtype, copy=False)


# --------------------------------------------------------------------------------------------
# TensorScatter
# --------------------------------------------------------------------------------------------
@register("TensorScatter", versions=(24,))
class TensorScatter(Op):
    """A copy of ``past_cache`` with ``update`` written along ``axis`` at each batch's write index
    (wrapping around in ``circular`` mode)."""

    def check(self) -> None:
        mode = self.attr("mode")
        if mode not in ("linear", "circular"):
            self.unsupported(f"mode={mode!r}")

    def run(self, past_cache: np.ndarray, update: np.ndarray, write_indices: np.ndarray | None = None) -> np.ndarray:
        axis = normalize_axis(self, self.attr("axis"), past_cache.ndim)
        if axis == 0 or update.ndim != past_cache.ndim:
            raise op_error(self, f"axis {axis} of a rank-{past_cache.ndim} cache with a rank-{update.ndim} update")
        batch, capacity, length = past_cache.shape[0], past_cache.shape[axis], update.shape[axis]
        starts = (np.zeros(batch, dtype=np.int64) if write_indices is None
                  else write_indices.astype(np.int64).reshape(batch))
        slots = starts[:, None] + np.arange(length)
        if self.attr("mode") == "circular":
            slots %= capacity
        elif slots.size and (slots.min() < 0 or slots.max() >= capacity):
            raise op_error(self, f"linear writes at {starts.tolist()} of {length} entries overflow the cache "
                                 f"length {capacity}")
        present = past_cache.copy()
        target = np.moveaxis(present, axis, 1)  # a view: writes land in ``present``
        target[np.arange(batch)[:, None], slots] = np.moveaxis(update, axis, 1)
        return present


# --------------------------------------------------------------------------------------------
# CausalConvWithState
# --------------------------------------------------------------------------------------------
def _silu(x: np.ndarray, alpha: float = 1.0) -> np.ndarray:
    return x * sigmoid(np, alpha * x)


@register("CausalConvWithState", versions=(27,))
class CausalConvWithState(Op):
    """Depthwise causal 1-D convolution over ``[past_state | input]``; the new state is the last
    ``k - 1`` positions of that sequence."""

    def check(self) -> None:
        if self.attr("activation") not in ("none", "silu", "swish"):
            self.unsupported(f"activation={self.attr('activation')!r}")

    def run(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None,
            past_state: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        batch, channels, _ = x.shape
        width = weight.shape[-1]
        if weight.shape != (channels, 1, width):
            raise op_error(self, f"weight shape {weight.shape} is not (channels={channels}, 1, k)")
        cd = compute_dtype(x.dtype)
        if past_state is None:
            past = np.zeros((batch, channels, width - 1), dtype=cd)
        else:
            past = past_state.astype(cd, copy=False)
        seq = np.concatenate([past, x.astype(cd, copy=False)], axis=2)
        windows = np.lib.stride_tricks.sliding_window_view(seq, width, axis=2)  # (B, C, L, k)
        with np.errstate(all="ignore"):
            y = np.einsum("bclk,ck->bcl", windows, weight[:, 0].astype(cd, copy=False))
            if bias is not None:
                y = y + bias.astype(cd, copy=False)[:, None]
            if self.attr("activation") != "none":
                y = _silu(y)
        state = seq[:, :, seq.shape[2] - (width - 1):]
        return y.astype(x.dtype), state.astype(x.dtype)


# --------------------------------------------------------------------------------------------
# SwiGLU (Swish itself is a line of the element-wise table, ops/pointwise.py)
# --------------------------------------------------------------------------------------------

@float_kernel
def _swiglu(a: np.ndarray, b: np.ndarray, alpha: float) -> np.ndarray:
    return _silu(a, alpha) * b.astype(a.dtype, copy=False)


@register("SwiGLU", versions=(28,))
class SwiGLU(Op):
    """``Swish_alpha(A) * B`` for equally shaped A and B (no broadcasting, per ONNX)."""

    def run(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if a.shape != b.shape:
            raise op_error(self, f"A {a.shape} and B {b.shape} must have the same shape")
        return _swiglu(a, b, float(self.attr("alpha")))
