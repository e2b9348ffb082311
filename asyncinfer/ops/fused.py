"""Ops that only the loader's fusions create, in asyncinfer's own domain (`FUSED_DOMAIN`).

Each is an exact composition of standard ONNX ops that no single ONNX op expresses (ONNX's
``Attention`` takes one mask; an exported GPT-2 applies a causal ``Where`` *and* an additive
padding mask). The layer that replaces the pattern keeps the pattern's layers
(``Layer.expansion``): a backend without a kernel for the fused op runs those instead, so a GPU
never hands the pattern to the CPU because of a fusion.
"""
from __future__ import annotations

import numpy as np

from ..concurrency import parallel
from ..concurrency.spin_team import addresses
from .base import Op
from .cache_append import concat_growing
from .compiled import blas_call
from .compiled.attention import PART_KIND as ATTENTION_PART
from .compiled.attention import PRODUCTS_PART_KIND as PRODUCTS_PART
from .compiled.gemm import PANELS_OVER_BLAS
from .compiled.attention import (attention_heads, head_arguments, masked_attention, product_arguments,
                                 products_from)
from .compiled.normalization import softmax_rows
from .compiled.rotary import rotate_half
from .linalg import Gemm, MatMul, blas_rows, constant_panels, matmul
from .registry import register
from .shape import (int_list, normalize_axis, op_error, reshape_dims, reshape_to, split_indices, split_views,
                    transpose_by)

#: The domain of the fused ops.
FUSED_DOMAIN = "ai.asyncinfer"
#: From this many multiply-adds an attention's heads are shared with the spin team's helpers.
#: Posting a part costs ~13 µs of Python: a GPT-2 decode step's one row (12 heads x 65 keys x
#: (64 + 64), 20 µs on one thread) took 33 µs split; eight rows (97 keys) 221 -> 160 µs.
ATTENTION_SPLIT_MIN_MACS = 1 << 19
#: Up to this many query rows an attention runs a compiled pass per row; from more on, two BLAS
#: products per head (`compiled.attention.attention_products`). Keys 128, 2 heads of 64: 1 row
#: 7 against 23 µs, 8 rows 27 against 32, 16 rows 79 against 43, 128 rows 619 against 202.
FEW_QUERY_ROWS = 8
# Attention's two products a head on asyncinfer's panel GEMM rather than BLAS where it is the
# faster (`compiled.gemm.PANELS_OVER_BLAS`): BERT-tiny's 128 x 64 @ 64 x 128 scores and 128 x 128
# @ 128 x 64 values 8.7 µs each on one core, 19 with OpenBLAS's Haswell kernels.
PANEL_PRODUCTS = PANELS_OVER_BLAS


@register("MaskedAttention", versions=(1,), domain=FUSED_DOMAIN)
class MaskedAttention(Op):
    """``Softmax(Add(Where(keep, Div(MatMul(Q, Transpose(K)), scale), fill), bias)) @ V``, the
    attention of exported decoders, each of ``scale``, ``keep``/``fill`` and ``bias`` optional.

    Inputs: ``Q (…, S, D)``, ``K (…, T, D)`` (not transposed), ``V (…, T, Dv)``, ``scale`` (a
    scalar; attribute ``scale_divides``: 1 divides by it, 0 multiplies), ``keep`` (bool) and
    ``fill`` (a scalar) for the ``Where``, ``bias`` added after it; the masks broadcast against the
    scores ``(…, S, T)`` as the ops they replace did. The softmax is over the last axis.

    Grouped-query attention: K and V may come as the inputs of the ``Unsqueeze(axis 2) → Expand
    → Reshape`` that repeats each K/V head for its query heads (inputs 7-10: the Expand's shape and
    the Reshape's, for K then V; attributes ``k_allowzero``/``v_allowzero``, the Reshapes'). When
    those shapes repeat heads (``(B, Hkv, T, D)`` → ``(B, Hkv·g, T, D)``) the heads are shared,
    never copied; any other shapes are applied as the three ops would.

    Attribute ``out_perm``: the ``Transpose`` that merges the heads back (``(B, H, S, D)`` →
    ``(B, S, H, D)``), when it is the attention's only reader, is applied to the result (a view).
    Attributes ``q_perm``, ``k_perm``, ``v_perm``: the ``Transpose`` that split Q, K or V into
    heads, taken in (an encoder's ``(B, S, H, D)`` → ``(B, H, S, D)``; for K, the perm that gives
    K itself, its ``Transpose`` to ``Kᵀ`` with the last two axes swapped back): the input is the
    tensor before it, and the op reads it through a transposed view, never a copy.

    Float32 Q, K and V of shape ``(B, H, S, D)`` run compiled (``compiled/attention.py``): up to
    `FEW_QUERY_ROWS` query rows (a decode step) in one pass per row, dot products as SIMD partial
    sums; more (an encoder, a prefill) as two BLAS products a block of rows per head, the
    masking and softmax in between, the result written in the merged heads' layout when
    ``out_perm`` asks for it. Either differs from the unfused layers by rounding alone. Other
    shapes take the unfused layers' arithmetic step by step; narrower floats are computed in
    float32 and rounded once, at the output.
    """

    multithreaded = True  # two batched GEMMs, as the MatMuls it replaces
    value_inputs = (7, 8, 9, 10)  # the head repeats' shapes

    def check(self) -> None:
        names = list(self.layer.inputs) + [""] * 11
        if not (names[0] and names[1] and names[2]):
            self.unsupported("Q, K and V are required")
        if bool(names[4]) != bool(names[5]) or bool(names[7]) != bool(names[8]) or bool(names[9]) != bool(names[10]):
            self.unsupported("keep without fill, or a head repeat's Expand shape without its Reshape's")
        self.divides = bool(int(self.attr("scale_divides", 1)))
        self.allowzero = (bool(int(self.attr("k_allowzero", 0))), bool(int(self.attr("v_allowzero", 0))))
        perm = self.attr("out_perm", None)
        self.out_perm = None if perm is None else [int(p) for p in perm]
        self.in_perms = [(slot, [int(p) for p in perm]) for slot, perm in
                         enumerate(self.attr(f"{x}_perm", None) for x in "qkv") if perm is not None]
        for _, perm in self.in_perms + ([(3, self.out_perm)] if self.out_perm is not None else []):
            if sorted(perm) != list(range(len(perm))):
                self.unsupported(f"perm {perm} is not a permutation")
        self._out_inverse = None if self.out_perm is None else [int(p) for p in np.argsort(self.out_perm)]
        # The last compiled run's case (see `_remember`): the same case again takes the short way.
        self._known: tuple | None = None

    def run(self, *inputs: np.ndarray | None) -> np.ndarray:
        if self.in_perms:
            taken = list(inputs)
            for slot, perm in self.in_perms:
                taken[slot] = self._permuted(np.asarray(taken[slot]), perm, "QKV"[slot])
            inputs = tuple(taken)
        known = self._known
        if known is not None:
            y = self._again(known, inputs)
            if y is not None:
                return y if self.out_perm is None else y.transpose(self.out_perm)
        y = self._attend(*inputs)
        if isinstance(y, tuple):  # (a compiled run: its case is remembered)
            self._remember(inputs, *y[1:])
        y = y[0] if isinstance(y, tuple) else y
        return y if self.out_perm is None else self._permuted(y, self.out_perm, "the result")

    def _permuted(self, x: np.ndarray, perm: list[int], what: str) -> np.ndarray:
        """``x`` transposed by ``perm`` (a view; `check` made sure it is a permutation)."""
        if x.ndim != len(perm):
            raise op_error(self, f"{what} of rank {x.ndim} cannot take the perm {perm}")
        return x.transpose(perm)

    def _attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: np.ndarray | None = None,
                keep: np.ndarray | None = None, fill: np.ndarray | None = None, bias: np.ndarray | None = None,
                k_expand: np.ndarray | None = None, k_shape: np.ndarray | None = None,
                v_expand: np.ndarray | None = None, v_shape: np.ndarray | None = None
                ) -> np.ndarray | tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The attention; ``(y, q, k, v)`` when the compiled kernel ran on ``q``, ``k`` and ``v``."""
        out_dtype = q.dtype
        if q.dtype.kind != "f" or k.dtype != q.dtype or v.dtype != q.dtype:
            raise op_error(self, f"Q, K and V must be of one float type, got {q.dtype}, {k.dtype}, {v.dtype}")
        work = np.float64 if q.dtype == np.float64 else np.float32
        q, k, v = (x.astype(work, copy=False) for x in (q, k, v))
        k, k_group = self._repeat(k, k_expand, k_shape, self.allowzero[0], "K")
        v, v_group = self._repeat(v, v_expand, v_shape, self.allowzero[1], "V")
        group = k_group if k_group == v_group and q.ndim == 4 and q.shape[1] == k.shape[1] * k_group else 1
        if group == 1:  # heads not shared alike: as the Expand and Reshape made them
            k, v = _repeat_heads(k, k_group), _repeat_heads(v, v_group)
        if q.ndim < 2 or k.ndim < 2 or v.ndim < 2 or q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
            raise op_error(self, f"shapes Q {q.shape}, K {k.shape}, V {v.shape} do not make an attention")
        if work == np.float32 and out_dtype == np.float32:
            y = self._compiled(q, k, v, scale, keep, fill, bias, group)
            if y is not None and q.shape[2] > FEW_QUERY_ROWS:
                return y  # (two products: nothing to remember, see `_remember`)
            if y is not None:
                return y, q, k, v
        k, v = _repeat_heads(k, group), _repeat_heads(v, group)  # the general path's MatMuls need them
        with np.errstate(all="ignore"):
            scores = matmul(q, np.swapaxes(k, -1, -2))
            if scale is not None:
                s = np.asarray(scale).astype(work)
                scores = np.divide(scores, s, out=scores) if self.divides else np.multiply(scores, s, out=scores)
            if keep is not None:
                scores = np.where(keep, scores, np.asarray(fill).astype(work))
            if bias is not None:
                bias = bias.astype(work, copy=False)
                if np.broadcast_shapes(scores.shape, bias.shape) == scores.shape:
                    np.add(scores, bias, out=scores)  # scores is this run's own array
                else:
                    scores = scores + bias
            probs = _softmax_last(scores)
            y = matmul(probs, v)
        return y.astype(out_dtype, copy=False)


    def _repeat(self, x: np.ndarray, expand: np.ndarray | None, shape: np.ndarray | None, allowzero: bool,
                what: str) -> tuple[np.ndarray, int]:
        """``x`` as ``Reshape(Expand(Unsqueeze(x, 2), expand), shape)`` leaves it: ``(x, g)`` when
        that repeats each of x's heads ``g`` times in a row (the kernel then shares them, see
        `_repeat_heads`), else the tensor the three ops make and 1; ``(x, 1)`` without ``expand``."""
        if expand is None:
            return x, 1
        if x.ndim < 2:
            raise op_error(self, f"{what} of shape {x.shape} has no axis 2 to repeat heads along")
        unsqueezed = x.shape[:2] + (1,) + x.shape[2:]
        try:
            expanded = np.broadcast_shapes(unsqueezed, tuple(int(d) for d in np.asarray(expand).reshape(-1)))
        except ValueError as exc:
            raise op_error(self, f"cannot expand {what} {unsqueezed} to {np.asarray(expand).tolist()}") from exc
        dims = [int(d) for d in np.asarray(shape).reshape(-1)]
        if not allowzero:
            dims = [expanded[i] if d == 0 and i < len(expanded) else d for i, d in enumerate(dims)]
        g = expanded[2] if len(expanded) == 5 else 0
        if (x.ndim == 4 and g >= 1 and expanded == x.shape[:2] + (g,) + x.shape[2:]
                and dims in ([x.shape[0], x.shape[1] * g, x.shape[2], x.shape[3]],
                             [x.shape[0], -1, x.shape[2], x.shape[3]])):
            return x, g
        try:
            return np.broadcast_to(x.reshape(unsqueezed), expanded).reshape(dims), 1
        except ValueError as exc:
            raise op_error(self, f"cannot reshape {what} {expanded} into {dims}") from exc

    def _compiled(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: np.ndarray | None,
                  keep: np.ndarray | None, fill: np.ndarray | None, bias: np.ndarray | None,
                  group: int = 1) -> np.ndarray | None:
        """The float32 4-D case in one compiled pass per query row (`compiled.attention`); None
        where that kernel does not apply (broadcast batches, other ranks, a mask widening the
        scores). ``group``: query heads per K/V head (a repeat the kernel does by indexing)."""
        if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or not q.size or not k.shape[2]:
            return None
        batch, heads, queries, _ = q.shape
        kv_heads, keys = k.shape[1], k.shape[2]
        if (k.shape[0] != batch or v.shape[0] != batch or v.shape[1] != kv_heads
                or not (kv_heads * group == heads or (group == 1 and kv_heads == 1))
                or any(x.strides[3] != 4 and x.shape[3] > 1 for x in (q, k, v))):
            return None
        full = (batch, heads, queries, keys)
        masks = []
        for mask, dtype, none in ((keep, np.bool_, _NO_KEEP), (bias, np.float32, _NO_BIAS)):
            if mask is None:
                masks.append(none)
                continue
            if mask.ndim > 4 or any(d not in (1, f) for d, f in zip(mask.shape[::-1], full[::-1])):
                return None  # a mask that widens the scores (or does not fit): the general path
            masks.append(mask.astype(dtype, copy=False).reshape((1,) * (4 - mask.ndim) + mask.shape))
        scale_value = 1.0 if scale is None else float(np.asarray(scale).item())
        fill_value = 0.0 if fill is None else float(np.asarray(fill).item())
        if queries > FEW_QUERY_ROWS and v.shape[3] and blas_call.available():
            return self._by_products(q, k, v, scale_value, scale is not None, masks[0], fill_value,
                                     keep is not None, masks[1], bias is not None, kv_heads)
        y = np.empty((batch, heads, queries, v.shape[3]), np.float32)
        if not _heads_on_team(q, k, v, scale_value, self.divides, scale is not None, masks[0], fill_value,
                              keep is not None, masks[1], bias is not None, y):
            masked_attention(q, k, v, scale_value, self.divides, scale is not None, masks[0], fill_value,
                             keep is not None, masks[1], bias is not None, y)
        return y

    def _by_products(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, use_scale: bool,
                     keep: np.ndarray, fill: float, use_keep: bool, bias: np.ndarray, use_bias: bool,
                     kv_heads: int) -> np.ndarray:
        """`_compiled` for many query rows: `compiled.attention.attention_products`, its heads
        shared with the spin team's free helpers. Q, K and V are read in place where BLAS can
        (rows of unit stride); the result is made in ``out_perm``'s layout and returned as its
        ``(B, H, S, Dv)`` view, so that `run`'s transpose gives back a contiguous array."""
        batch, heads, queries, depth = q.shape
        keys, width = k.shape[2], v.shape[3]
        q, k, v = (x if _rows_in_place(x) else np.ascontiguousarray(x) for x in (q, k, v))
        full = (batch, heads, queries, width)
        perm = self.out_perm
        if perm is not None and len(perm) == 4:
            y = np.empty(tuple(full[p] for p in perm), np.float32).transpose(self._out_inverse)
        else:
            y = np.empty(full, np.float32)
        places = [at for x, at in zip((q, k, v, y), addresses(q, k, v, y)[:4]) for at in (at, *x.strides[:3])]
        shape = np.array([batch, heads, kv_heads, queries, keys, depth, width], np.int64)
        numbers = np.array([scale, fill], np.float64)
        keep = np.ascontiguousarray(keep).view(np.uint8)
        bias = np.ascontiguousarray(bias)
        team = parallel.team(PRODUCTS_PART)
        parts = 1
        if team is not None and heads >= 2 and batch * heads * queries * keys * (depth + width) >= ATTENTION_SPLIT_MIN_MACS:
            parts = min(team.helpers + 1, heads)
        bounds = [heads * i // parts for i in range(parts + 1)]
        first = product_arguments(places, shape, numbers, self.divides, use_scale, keep, use_keep, bias, use_bias,
                                  0, bounds[1], PANEL_PRODUCTS)
        own = np.array(first[1:], np.int64)  # (after the part's kind)
        if parts > 1:
            posted = [first[:-2] + [bounds[i], bounds[i + 1]] for i in range(1, parts)]
            if team.try_run(posted, lambda: products_from(own, 0)):  # type: ignore[union-attr]
                return y
            own[-1] = heads  # (the team was taken meanwhile: every head here)
        products_from(own, 0)
        return y

    def _remember(self, inputs: tuple, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Keep the case of a compiled run whose inputs the kernel took as they came (float32, no
        head repeat copied, masks already 4-D): a decode step runs each attention with the same
        shapes but the cache's length, the same scale and fill constants and the same head-repeat
        shapes every step, and ~15 µs of Python a call (more, run cold after a GEMM) then become a
        few comparisons. `_again` calls the kernel as `_compiled` does, so the bits are the same.
        (The head repeats' shapes are compared by identity: a plan's constants, or arrays a run
        computes afresh; the scale and fill values are read again each call.)"""
        padded = inputs + (None,) * 7
        masks = padded[4], padded[6]
        if (q is not inputs[0] or k is not inputs[1] or v is not inputs[2] or q.shape[2] > FEW_QUERY_ROWS
                or any(m is not None and (m.ndim != 4 or m.dtype != d) for m, d in zip(masks, (np.bool_, np.float32)))
                or (self.out_perm is not None and sorted(self.out_perm) != [0, 1, 2, 3])):
            return
        # the inputs that must be the same objects again: scale, fill and the head repeats' shapes
        same = tuple((i, inputs[i]) for i in (3, 5, 7, 8, 9, 10) if i < len(inputs) and inputs[i] is not None)
        repeats = any(x is not None for x in inputs[7:])  # (their values hold the cache's length)
        self._known = (len(inputs), same, q.shape, k.shape if repeats else k.shape[:2] + k.shape[3:],
                       v.shape if repeats else v.shape[:2] + v.shape[3:],
                       tuple(None if m is None else m.shape[:3] for m in masks))

    def _again(self, known: tuple, inputs: tuple) -> np.ndarray | None:
        """The attention of ``inputs`` when they are the remembered case (`_remember`), else None."""
        count, same, q_shape, k_key, v_key, mask_keys = known
        if len(inputs) != count:
            return None
        for i, value in same:
            if inputs[i] is not value:
                return None
        q, k, v = inputs[0], inputs[1], inputs[2]
        repeats = len(k_key) == 4
        if (q.shape != q_shape or (k.shape if repeats else k.shape[:2] + k.shape[3:]) != k_key
                or (v.shape if repeats else v.shape[:2] + v.shape[3:]) != v_key or k.shape[2] != v.shape[2]
                or q.dtype != np.float32 or k.dtype != np.float32 or v.dtype != np.float32
                or k.strides[3] != 4 or v.strides[3] != 4 or (q.strides[3] != 4 and q.shape[3] > 1)
                or not k.shape[2]):
            return None
        keys = k.shape[2]
        padded = inputs + (None,) * 7
        keep, bias = padded[4], padded[6]
        for mask, key, dtype in ((keep, mask_keys[0], np.bool_), (bias, mask_keys[1], np.float32)):
            if (mask is None) != (key is None) or (mask is not None and (
                    mask.ndim != 4 or mask.shape[:3] != key or mask.dtype != dtype or mask.shape[3] not in (1, keys))):
                return None
        keep_in = _NO_KEEP if keep is None else keep
        bias_in = _NO_BIAS if bias is None else bias
        # (read each call: the same array may hold another value, were it an input someone refilled)
        scale = 1.0 if len(inputs) < 4 or inputs[3] is None else float(np.asarray(inputs[3]).item())
        fill = 0.0 if len(inputs) < 6 or inputs[5] is None else float(np.asarray(inputs[5]).item())
        y = np.empty(q_shape[:3] + v.shape[3:], np.float32)
        use_scale, use_keep, use_bias = len(inputs) > 3 and inputs[3] is not None, keep is not None, bias is not None
        if not _heads_on_team(q, k, v, scale, self.divides, use_scale, keep_in, fill, use_keep, bias_in, use_bias, y):
            masked_attention(q, k, v, scale, self.divides, use_scale, keep_in, fill, use_keep, bias_in, use_bias, y)
        return y


def _heads_on_team(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, divides: bool, use_scale: bool,
                   keep: np.ndarray, fill: float, use_keep: bool, bias: np.ndarray, use_bias: bool,
                   y: np.ndarray) -> bool:
    """Run `masked_attention` with its query heads shared between this thread and the CPU
    backend's spinning helpers (`concurrency/spin_team.py`), each part a band of heads; False,
    having run nothing, when the team is busy or absent or the attention too small to pay.

    A decode step's attention reads the whole KV cache (GPT-2 with 8 streams: ~4 MB a layer,
    coming from memory after the GEMMs); two cores read it faster than one. Every row is computed
    as in one piece, so the bits do not depend on the split."""
    heads = q.shape[1]
    work = q.shape[0] * heads * q.shape[2] * k.shape[2] * (k.shape[3] + v.shape[3])
    team = parallel.team(ATTENTION_PART)
    if team is None or heads < 2 or work < ATTENTION_SPLIT_MIN_MACS:
        return False
    parts = min(team.helpers + 1, heads)
    bounds = [heads * i // parts for i in range(parts + 1)]
    q = np.ascontiguousarray(q)
    keep = np.ascontiguousarray(keep).view(np.uint8)
    bias = np.ascontiguousarray(bias)
    numbers = np.array([scale, fill], np.float64)
    posted = [head_arguments(q, k, v, numbers, divides, use_scale, keep, use_keep, bias, use_bias, y, bounds[i],
                             bounds[i + 1]) for i in range(1, parts)]
    return team.try_run(posted, lambda: attention_heads(
        q, k.ctypes.data, *k.strides[:3], v.ctypes.data, *v.strides[:3], k.shape[1], k.shape[2], v.shape[3], scale,
        divides, use_scale, keep, fill, use_keep, bias, use_bias, y, 0, bounds[1]))


def _rows_in_place(x: np.ndarray) -> bool:
    """Whether BLAS reads the rows of each head of the 4-D float32 ``x`` in place (`blas_rows`
    of one head), the heads and batch entries a whole number of non-negative elements apart."""
    return blas_rows(x[0, 0]) and all(st >= 0 and st % 4 == 0 for st in x.strides[:2])


def _repeat_heads(x: np.ndarray, group: int) -> np.ndarray:
    """``x (B, Hkv, T, D)`` with each head repeated ``group`` times in a row (a copy), as an
    ``Unsqueeze(2) → Expand → Reshape`` head repeat makes it."""
    return x if group == 1 else np.repeat(x, group, axis=1)


_NO_KEEP = np.ones((1, 1, 1, 1), bool)
_NO_BIAS = np.zeros((1, 1, 1, 1), np.float32)


def _softmax_last(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, as the ``Softmax`` op computes it (one compiled pass per row
    for float32), in place when ``scores`` is a contiguous float32 array."""
    if scores.size == 0:
        return scores
    if scores.dtype == np.float32:
        if not scores.flags.c_contiguous:
            scores = np.ascontiguousarray(scores)
        rows = scores.reshape(-1, scores.shape[-1])
        softmax_rows(rows, rows)
        return scores
    e = np.exp(scores - np.max(scores, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)



@register("RotaryHalfEmbedding", versions=(1,), domain=FUSED_DOMAIN)
class RotaryHalfEmbedding(Op):
    """``Add(Mul(X, cos), Mul(Concat(Neg(Slice(X, split:end)), Slice(X, 0:split)), sin))`` along
    the last axis: the rotary position embedding of Llama-style exports ("rotate half"), seven
    layers per Q and per K of every block.

    Attributes ``split`` and ``end`` are the Slices' bounds (``X[..., split:end]`` and
    ``X[..., :split]``, clamped as Slice clamps them); ``cos`` and ``sin`` broadcast as the Muls
    did. The arithmetic is the layers' own (two products, then their sum), so the result has
    their bits; narrower floats are computed as the layers compute them.
    """

    def check(self) -> None:
        if len(self.layer.inputs) != 3 or not all(self.layer.inputs):
            self.unsupported("X, cos and sin are required")
        self.split, self.end = int(self.attr("split")), int(self.attr("end"))
        if self.split < 0 or self.end < 0:
            self.unsupported(f"negative bounds {self.split}:{self.end}")

    def run(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        if x.ndim < 1:
            raise op_error(self, "X must have at least one axis")
        y = self._compiled(x, cos, sin)
        if y is not None:
            return y
        rotated = np.concatenate([np.negative(x[..., self.split:self.end]), x[..., :self.split]], axis=-1)
        with np.errstate(all="ignore"):
            return np.add(np.multiply(x, cos), np.multiply(rotated, sin))

    def _compiled(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray | None:
        """The float32 case in one pass (`compiled.rotary`): X of rank 4 at most, its last axis
        the slices' whole (``end`` reaches it), cos and sin broadcasting to X's shape along a last
        axis of X's width; None for any other case (the layers' NumPy arithmetic). X is read in
        place, whatever its strides (Llama's Q: a transposed view); tables whose rows are not
        contiguous (a transposed table) are copied first, being a position's worth of X at most."""
        width = x.shape[-1]
        if (x.dtype != np.float32 or cos.dtype != np.float32 or sin.dtype != np.float32 or x.ndim > 4
                or min(self.end, width) != width or self.split > width or not x.size
                or cos.ndim > 4 or sin.ndim > 4 or cos.shape[-1:] != (width,) or sin.shape[-1:] != (width,)):
            return None
        shape = (1,) * (4 - x.ndim) + x.shape
        try:
            views = [np.broadcast_to((t if t.strides[-1] == 4 else np.ascontiguousarray(t)).reshape(
                (1,) * (4 - t.ndim) + t.shape), shape) for t in (cos, sin)]
        except ValueError:
            return None  # (a shape that widens X or does not fit: the layers say so)
        x4 = (x if x.strides[-1] == 4 else np.ascontiguousarray(x)).reshape(shape)
        y = np.empty(shape, np.float32)
        rotate_half(x4, views[0], views[1], self.split, y)  # type: ignore[arg-type]
        return y.reshape(x.shape)


@register("ReshapedGemm", versions=(1,), domain=FUSED_DOMAIN)
class ReshapedGemm(Gemm):
    """``Reshape(Gemm(Reshape(A, a_shape), B, C), y_shape)``, either Reshape optional: the
    projections of exported transformers, which flatten ``(batch, sequence, features)`` to two
    axes for a ``Gemm`` and give the axes back after it (GPT-2: seven Reshapes a block, layers a
    decode step dispatched one by one for no arithmetic).

    Inputs: ``A``, ``B``, ``C`` (optional) as Gemm's, then ``a_shape`` and ``y_shape`` (each
    optional: no Reshape there); attributes: Gemm's ``transA``, ``transB``, ``alpha``, ``beta``
    (always written out, there is no schema to default them) and ``a_allowzero``/``y_allowzero``,
    the Reshapes'. The arithmetic is Gemm's, the Reshapes are NumPy's views (or copies) as the
    Reshape layers made them, so the result has the three layers' bits and errors name this layer.
    """

    value_inputs = (3, 4)  # the Reshapes' targets

    def check(self) -> None:
        super().check()
        # The last plain run (see `_remember`): the same operands again take the short way.
        self._known: tuple | None = None

    def run(self, a: np.ndarray, b: np.ndarray, c: np.ndarray | None = None, a_shape: np.ndarray | None = None,
            y_shape: np.ndarray | None = None) -> np.ndarray:
        known = self._known
        if (known is not None and a.shape == known[0] and a.dtype == known[1] and b is known[2]
                and c is known[3] and a_shape is known[4] and y_shape is known[5]):
            flat = a.reshape(known[6])
            y = matmul(flat, b, known[8], constant_panels(self, flat, b, 1))
            return y if known[7] is None else y.reshape(known[7])
        x = a if a_shape is None else reshape_to(self, np.asarray(a), int_list(a_shape),
                                                 bool(self.attr("a_allowzero", 0)))
        y = Gemm.run(self, x, b, c)
        if y_shape is not None:
            y = reshape_to(self, y, int_list(y_shape), bool(self.attr("y_allowzero", 0)))
        self._remember(a, b, c, a_shape, y_shape, x, y)
        return y

    def _remember(self, a: np.ndarray, b: np.ndarray, c: np.ndarray | None, a_shape: np.ndarray | None,
                  y_shape: np.ndarray | None, x: np.ndarray, y: np.ndarray) -> None:
        """Keep this run's operands and shapes when it was the plain case (no transposes, alpha
        and beta 1, a bias row, one float type): a decode step runs each projection with the same
        weights, the same bias and the same (precomputed) targets every step, and 5-10 µs of
        Python a call (parsing targets, types, checks) are then an identity test. The short way
        calls `matmul` as `Gemm.run` would, so the bits are the same."""
        if (self.trans_a or self.trans_b or self.alpha != 1.0 or self.beta != 1.0 or c is None or x.ndim != 2
                or b.ndim != 2 or not a.dtype == b.dtype == c.dtype == y.dtype
                or a.dtype not in (np.float32, np.float64) or c.size != b.shape[1] or c.shape[-1:] != b.shape[1:]):
            return
        self._known = (a.shape, a.dtype, b, c, a_shape, y_shape, x.shape, None if y_shape is None else y.shape,
                       np.ascontiguousarray(c.reshape(-1)))


@register("ReshapeTranspose", versions=(1,), domain=FUSED_DOMAIN)
class ReshapeTranspose(Op):
    """``Transpose(Reshape(X, shape), perm)``: how exporters split attention heads (``(batch,
    sequence, heads · size)`` → ``(batch, heads, sequence, size)``), three times a transformer block;
    with input ``past``, ``Concat(past, that, axis=append_axis)`` too: the KV cache of a decoder
    with past growing by the step's keys or values.

    Inputs ``X``, ``shape`` and ``past`` (optional); attributes ``perm`` (the Transpose's, absent:
    reverse the axes), ``allowzero`` (the Reshape's) and ``append_axis`` (the Concat's). The
    Reshape and Transpose are NumPy views where the layers' were (or a copy where the Reshape made
    one), and the Concat appends in place as a cache's Concat does (``ops/cache_append.py``), so
    the result is the layers' own."""

    value_inputs = (1,)  # the Reshape's target

    def run(self, x: np.ndarray, shape: np.ndarray, past: np.ndarray | None = None) -> np.ndarray:
        y = reshape_to(self, np.asarray(x), int_list(shape), bool(self.attr("allowzero", 0)))
        y = transpose_by(self, y, self.attr("perm", None))
        return y if past is None else _append(self, past, y, self.attr("append_axis"))


#: The most parts a `SplitHeads` takes (Q, K and V, and one to spare): its inputs sit in fixed slots.
SPLIT_HEADS_PARTS = 4


@register("SplitHeads", versions=(1,), domain=FUSED_DOMAIN)
class SplitHeads(Op):
    """``Split(X)`` with each part made a `ReshapeTranspose` (each with or without its cache
    append): the fused Q/K/V projection of GPT-2-style attention split into heads, and K and V
    appended to the cache, in one layer (six of a block before).

    Inputs, in fixed slots: ``X`` (0), the Split's ``split`` sizes (1, optional), the parts'
    Reshape targets (2 to 5, one a part) and their caches (6 to 9, optional; "" where none).
    Attributes: the Split's ``axis`` and ``split`` (sizes given as an attribute, opsets < 13);
    per part, lists: ``perms`` (the Transposes', concatenated, each ``perm_rank`` long),
    ``allowzero`` (the Reshapes') and ``append_axes`` (the Concats'; unused without a cache).
    Each part's arithmetic is `split_views`, then `ReshapeTranspose`'s, so the outputs are the
    layers' own."""

    value_inputs = (1, 2, 3, 4, 5)  # the sizes and the Reshapes' targets

    def check(self) -> None:
        n = len(self.layer.outputs)
        names = list(self.layer.inputs) + [""] * (2 + 2 * SPLIT_HEADS_PARTS)
        if not 1 <= n <= SPLIT_HEADS_PARTS or not all(names[2:2 + n]):
            self.unsupported(f"{n} parts, each with its Reshape target, at most {SPLIT_HEADS_PARTS}")
        rank = int(self.attr("perm_rank"))
        perms = [int(p) for p in self.attr("perms")]
        if len(perms) != n * rank or len(self.attr("allowzero")) != n or len(self.attr("append_axes")) != n:
            self.unsupported(f"per-part attributes of {n} parts expected")
        self.perms = [perms[i * rank:(i + 1) * rank] for i in range(n)]
        self.allowzero = [bool(int(a)) for a in self.attr("allowzero")]
        self.append_axes = [int(a) for a in self.attr("append_axes")]
        # The last run's geometry, kept for the same operands again (see `_remember`).
        self._known: tuple | None = None

    def run(self, x: np.ndarray, split: np.ndarray | None = None, *rest: np.ndarray | None) -> tuple[np.ndarray, ...]:
        rest = rest + (None,) * (2 * SPLIT_HEADS_PARTS - len(rest))
        shapes, pasts = rest[:SPLIT_HEADS_PARTS], rest[SPLIT_HEADS_PARTS:]
        known = self._known
        if (known is not None and x.shape == known[0] and x.dtype == known[1] and split is known[2]
                and all(a is b for a, b in zip(shapes, known[3]))):
            outputs = []
            for (index, dims, perm, axis), past in zip(known[4], pasts):
                y = x[index].reshape(dims).transpose(perm)
                outputs.append(y if past is None else concat_growing([past, y], axis))
            return tuple(outputs)
        sizes = int_list(split) if split is not None else None
        if sizes is None and "split" in self.attrs:
            sizes = int_list(self.attrs["split"])
        x = np.asarray(x)
        parts = split_views(self, x, int(self.attr("axis")), sizes, len(self.perms))
        outputs = []
        for i, part in enumerate(parts):
            y = transpose_by(self, reshape_to(self, part, int_list(shapes[i]), self.allowzero[i]), self.perms[i])
            outputs.append(y if pasts[i] is None else _append(self, pasts[i], y, self.append_axes[i]))
        self._remember(x, split, shapes, parts)
        return tuple(outputs)

    def _remember(self, x: np.ndarray, split: np.ndarray | None, shapes: tuple, parts: tuple[np.ndarray, ...]) -> None:
        """Keep this run's geometry (each part's index, resolved Reshape target, perm and append
        axis) for the same input shape, sizes and target arrays again: a decode step's, every step
        (its targets are its plan's constants), where parsing them is ~15 µs of Python a call, run
        cold after a GEMM. The short way makes the same NumPy views and appends, so the same bits."""
        axis = normalize_axis(self, int(self.attr("axis")), x.ndim)
        indices = split_indices(x.ndim, axis, [p.shape[axis] for p in parts])
        geometry = []
        for i, part in enumerate(parts):
            dims = reshape_dims(part.shape, int_list(shapes[i]), self.allowzero[i])
            append = self.append_axes[i]
            if not -len(dims) <= append < len(dims):
                return  # (each run says what is wrong)
            geometry.append((indices[i], dims, self.perms[i], append % len(dims)))
        self._known = (x.shape, x.dtype, split, shapes, geometry)


def _append(op: Op, past: np.ndarray, new: np.ndarray, axis: int) -> np.ndarray:
    """``Concat(past, new, axis)`` of a KV cache, in place where it can be (``ops/cache_append.py``)."""
    past = np.asarray(past)
    return concat_growing([past, new], normalize_axis(op, axis, past.ndim))


@register("Magnitude", versions=(1,), domain=FUSED_DOMAIN)
class Magnitude(Op):
    """``Sqrt(Add(Mul(a, a), Mul(b, b)))``: the magnitude of a complex value kept as its real and
    imaginary parts, as audio models take it from an STFT (a voice-activity detector's convolution
    by a cos/sin basis, sliced into its two halves). Four layers of a few hundred values each
    that a streaming model pays as per-layer cost on every chunk. Each step is the layer it
    replaces (the same ufuncs on the same dtype, a narrow float's root taken in float32): the
    very bits of the four layers."""

    def run(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        total = np.asarray(np.add(np.multiply(a, a), np.multiply(b, b)))
        if total.dtype.itemsize >= 4:
            return np.sqrt(total, out=total)
        return np.sqrt(total.astype(np.float32)).astype(total.dtype)


@register("MatMulBias", versions=(1,), domain=FUSED_DOMAIN)
class MatMulBias(MatMul):
    """``MatMul(A, B) + bias``, ``B`` a 2-D weight and ``bias`` a row of its width: a transformer's
    projections as exporters write them (``nn.Linear`` on 3-D inputs: BERT, GPT-2), two layers of
    which the second only adds a row. The product is `MatMul`'s; the row is added in place (by the
    few-row kernel as it ends, or right after BLAS) instead of into a new array, so the result has
    the two layers' bits, and the layer's fused activations (``Add+Gelu``) run on it after.
    """

    def run(self, a: np.ndarray, b: np.ndarray, bias: np.ndarray) -> np.ndarray:  # type: ignore[override]
        if (a.dtype == b.dtype == bias.dtype == np.float32 and b.ndim == 2 and a.ndim >= 2
                and bias.shape == (b.shape[1],) and a.shape[-1] == b.shape[0]):
            return matmul(a, b, bias, constant_panels(self, a, b, 1))
        return np.add(MatMul.run(self, a, b), bias)
