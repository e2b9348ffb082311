"""MatMul and Gemm: one fragment computes four consecutive columns of one output row.

The product is drawn in texel mode over the output blocked along its last axis. Each step of the
``k`` loop fetches one texel of A (four ``k`` of the row) and the four texels of B holding rows
``k..k+3`` of the fragment's four columns: 16 multiply-adds for 5 fetches. The operands are read
in fixed arrangements:

- A as *rows*: a last-axis blocked ``(batch, M, K)`` tensor, texel ``(b·M + m)·KB + k/4``. A tensor
  in another layout (a channel-blocked NCHW tensor flattened, Gemm's ``transA``) is first copied
  into it by one draw of ``M·K`` values, cheap next to the ``M·N·K`` multiply-adds.
- B either as *rows* too (a runtime B: last-axis blocked ``(batch, K, N)``, copied first when it
  is not), where texel ``B[k, 4j..4j+3]`` is ``(b·K + k)·NB + j``; or, for a constant B packed on
  the host by `MatMul.prepare_constant`, as *streams*: the ``K`` texels of column block
  ``j`` are consecutive, ``(b·NB + j)·K + k``, so each fragment reads its B texels in order.

The remainder of ``K`` past the last multiple of 4 is unrolled at compile time: B rows past ``K``
are never fetched, and A's padding lanes (0 by the layout's rule) are never relied on.

A product with few output texels and a long ``K`` (a batch-1 classifier: 1×25088 @ 25088×4096)
is split along ``K``: one draw writes the partial sums of up to 16 chunks as extra output rows,
a second adds them (with alpha, C and the fused activation). llvmpipe shades 4×4 pixel blocks
on a few threads, so a one-row output would leave most SIMD lanes idle; the split fills them
(about 2× faster there).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..layout import Layout
from .base import PixelKernel, broadcast_index, glsl_float, pixel_kernel

if TYPE_CHECKING:
    from ....model.ir import Layer
    from ....ops.base import Op
    from ..device import PixelDevice
    from ..storage import PixelTensor

#: Tag of a constant B packed as column-block streams (see the module docstring).
STREAMS_TAG = "matmul-b-streams"


@dataclass(frozen=True)
class Product:
    """The shapes of one (batched) matrix product ``A' @ B'``, after NumPy's matmul rules."""

    a_batch: tuple[int, ...]
    b_batch: tuple[int, ...]
    batch: tuple[int, ...]
    m: int
    k: int
    n: int
    out_shape: tuple[int, ...]

    @property
    def rows(self) -> int:
        """Output rows over all batches (the output layout's ``outer``)."""
        return math.prod(self.batch) * self.m

    @property
    def layout(self) -> Layout:
        return Layout(self.rows, self.n, 1)


def matmul_product(a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> Product:
    """numpy.matmul's shape rules: 1-D operands gain (and the result loses) a unit axis."""
    a2 = (1,) + tuple(a_shape) if len(a_shape) == 1 else tuple(a_shape)
    b2 = tuple(b_shape) + (1,) if len(b_shape) == 1 else tuple(b_shape)
    if a2[-1] != b2[-2]:
        raise ValueError(f"MatMul: inner dimensions differ, {a_shape} @ {b_shape}")
    batch = tuple(np.broadcast_shapes(a2[:-2], b2[:-2]))
    out = batch + ((a2[-2],) if len(a_shape) > 1 else ()) + ((b2[-1],) if len(b_shape) > 1 else ())
    return Product(a2[:-2], b2[:-2], batch, a2[-2], a2[-1], b2[-1], out)


def gemm_product(a_shape: tuple[int, ...], b_shape: tuple[int, ...], trans_a: bool, trans_b: bool) -> Product:
    """Gemm's shapes: 2-D operands, optionally transposed."""
    m, k = a_shape[::-1] if trans_a else a_shape
    k2, n = b_shape[::-1] if trans_b else b_shape
    if k != k2:
        raise ValueError(f"Gemm: inner dimensions differ, A' is {m}x{k} and B' is {k2}x{n}")
    return Product((), (), (), m, k, n, (m, n))


# -- operand arrangements -------------------------------------------------------------------------
def as_rows(device: PixelDevice, x: PixelTensor, shape: tuple[int, ...], transposed: bool = False) -> PixelTensor:
    """``x`` as a last-axis blocked tensor of ``shape`` (..., R, C): itself when its layout already
    is, else a copy draw. ``transposed``: ``x`` holds the 2-D ``(C, R)`` matrix instead."""
    want = Layout(math.prod(shape[:-1]), shape[-1], 1)
    if not transposed and x.layout == want:
        return x if x.shape == shape else x.view(shape)
    rows, cols = shape[-2], shape[-1]
    source = f"(i % {cols}) * {rows} + i / {cols}" if transposed else "i"
    body = f"float value(int i) {{ return X_at({source}); }}"
    return device.draw(shape, body, {"X": x}, mode="value", layout=want)


def pack_streams(b: np.ndarray, transposed: bool = False) -> tuple[np.ndarray, Layout]:
    """Host packing of a constant B' (``b``, or the 2-D ``b.T`` when ``transposed``) of shape
    ``(batch, K, N)`` as column-block streams: texel ``(b·NB + j)·K + k`` holds ``B'[b, k, 4j..4j+3]``
    (zero past N). The array comes in texel order, ``(batch, NB, K, 4)``, so the upload's own
    packing is a plain copy."""
    if transposed:  # b is (N, K): column block j of B' is rows 4j..4j+3 of b
        n, k = b.shape
        rows = _pad_to_four(b.reshape(1, n, k), axis=1)
        return _texel_order(rows.reshape(1, -1, 4, k).transpose(0, 1, 3, 2))
    k, n = b.shape[-2:]
    cols = _pad_to_four(b.reshape(-1, k, n), axis=2)
    return _texel_order(cols.reshape(cols.shape[0], k, -1, 4).transpose(0, 2, 1, 3))


def _pad_to_four(x: np.ndarray, axis: int) -> np.ndarray:
    """``x`` with zeros appended along ``axis`` up to a multiple of 4."""
    extra = -x.shape[axis] % 4
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return np.pad(x, widths)


def _texel_order(blocks: np.ndarray) -> tuple[np.ndarray, Layout]:
    """A ``(batch, NB, K, 4)`` view as a contiguous array, and its one-texel-per-row layout."""
    packed = np.ascontiguousarray(blocks, dtype=np.float32)
    return packed, Layout(packed.size // 4, 4, 1)


def upload_texels(device: PixelDevice, packed: np.ndarray, layout: Layout, tag: str) -> PixelTensor:
    """(GL thread) Upload an array already in texel order (one texel per row of 4): what
    ``device.upload`` does, without its repacking copies (seconds for a 400 MB weight)."""
    tensor = device.empty(packed.shape, np.float32, layout, tag=tag)
    width, height = tensor.surface.size
    texels = packed.reshape(-1, 4)
    full = len(texels) // width  # whole texture rows, then the partial last one (zero padded)
    if full:
        tensor.surface.texture.write(texels[:full * width], viewport=(0, 0, width, full))
    if full < height:
        last = np.zeros((width, 4), np.float32)
        last[:len(texels) - full * width] = texels[full * width:]
        tensor.surface.texture.write(last, viewport=(0, full, width, 1))
    return tensor


# -- shader ------------------------------------------------------------------------------------------
#: Split ``K`` when the output has fewer texels than this: llvmpipe shades 4x4 pixel blocks, so a
#: one-row output (a batch-1 classifier) leaves most lanes idle, and few fragments leave cores idle.
SPLIT_BELOW_TEXELS = 8192
#: Fewest k-steps (of 4) per split chunk, and most chunks.
MIN_CHUNK_STEPS, MAX_SPLITS = 32, 16


def choose_splits(p: Product) -> int:
    """How many ``K`` chunks to sum separately (1: no split)."""
    texels = p.layout.texels
    if texels >= SPLIT_BELOW_TEXELS:
        return 1
    wanted = min(MAX_SPLITS, -(-SPLIT_BELOW_TEXELS // texels), (p.k // 4) // MIN_CHUNK_STEPS)
    if wanted <= 1:
        return 1
    chunk = -(-(p.k // 4) // wanted)
    return -(-(p.k // 4) // chunk)  # no empty chunk


def product_body(p: Product, streams: bool, splits: int = 1, epilogue: str = "") -> str:
    """The texel-mode body of ``A @ B`` for product ``p``. With ``splits`` > 1 it draws partial sums
    of shape ``(splits, rows, N)``, chunk ``s`` over k-steps ``[s·CH, (s+1)·CH)``, which
    `sum_body` adds. ``epilogue``: GLSL statements that may rewrite ``v`` (the sums) with
    ``m`` and ``block`` in scope."""
    kb, nb, full, rest = -(-p.k // 4), -(-p.n // 4), p.k // 4, p.k % 4
    a_row = broadcast_index("bo", p.batch, p.a_batch)
    b_mat = broadcast_index("bo", p.batch, p.b_batch)
    if streams:  # column block `block` of matrix b_mat: K consecutive texels
        b_base, step = f"(({b_mat}) * {nb} + block) * {p.k}", 1
    else:  # row k of matrix b_mat: texel (b_mat·K + k)·NB + block
        b_base, step = f"({b_mat}) * {p.k * nb} + block", nb
    if splits == 1:
        chunk = "int row = outer; const int k0 = 0; const int steps = %d;" % full
        last = "true"
    else:
        size = -(-full // splits)
        chunk = (f"int row = outer % {p.rows}; int s = outer / {p.rows}; "
                 f"int k0 = s * {size}; int steps = min({size}, {full} - k0);")
        last = f"s == {splits - 1}"
    lanes = "xyzw"
    tail = " ".join(f"s{j} += a.{lanes[j]} * B_texel(bt + {j * step});" for j in range(rest))
    tail_code = f"if ({last}) {{ vec4 a = A_texel(ar + steps); {tail} }}" if rest else ""
    return f"""
vec4 texel(int t, int outer, int block, int inner) {{
    {chunk}
    int m = row % {p.m}; int bo = row / {p.m};
    int ar = (({a_row}) * {p.m} + m) * {kb} + k0;
    int bt = {b_base} + k0 * {4 * step};
    // four sums, one per k lane: independent chains, and fewer rounding steps per sum
    vec4 s0 = vec4(0.0), s1 = vec4(0.0), s2 = vec4(0.0), s3 = vec4(0.0);
    for (int k = 0; k < steps; ++k, bt += {4 * step}) {{
        vec4 a = A_texel(ar + k);
        s0 += a.x * B_texel(bt);
        s1 += a.y * B_texel(bt + {step});
        s2 += a.z * B_texel(bt + {2 * step});
        s3 += a.w * B_texel(bt + {3 * step});
    }}
    {tail_code}
    vec4 v = (s0 + s1) + (s2 + s3);
    {epilogue}
    return v;
}}
"""


def sum_body(p: Product, splits: int, epilogue: str) -> str:
    """Texel-mode body adding the ``splits`` partial products ``P`` (see `product_body`)."""
    terms = " + ".join(f"P_texel(t + {s * p.layout.texels})" for s in range(splits))
    return f"""
vec4 texel(int t, int outer, int block, int inner) {{
    int m = outer % {p.m};
    vec4 v = {terms};
    {epilogue}
    return v;
}}
"""


def bias_fetch(c: PixelTensor, p: Product) -> str:
    """GLSL vec4 of Gemm's C broadcast to the fragment's four columns (row ``m``, block ``block``)."""
    shape = tuple(c.shape)
    if c.size == 1:
        return "vec4(C_at(0))"
    if math.prod(shape[:-1]) == 1 and shape[-1] == p.n and c.layout == Layout(1, p.n, 1):
        return "C_texel(block)"  # a row vector, blocked like the output's columns
    if shape == (p.m, p.n) and c.layout == p.layout:
        return "C_texel(t)"
    out = (p.m, p.n)
    lanes = ", ".join(
        f"C_at({broadcast_index(f'(m * {p.n} + min(4 * block + {j}, {p.n - 1}))', out, shape)})"
        for j in range(4))
    return f"vec4({lanes})"


# -- kernels ----------------------------------------------------------------------------------------
class _Product(PixelKernel):
    """Shared by MatMul and Gemm: B packing for constants, and the product draw."""

    fuses_activation = True
    trans_b = False

    def __init__(self, layer: Layer, op: Op):
        super().__init__(layer, op)
        self.constant_b_shape: tuple[int, ...] = ()  # the shape of B as given, when it was packed

    def prepare_constant(self, device: PixelDevice, index: int, array: np.ndarray) -> PixelTensor | None:
        b = np.asarray(array)
        if index != 1 or b.dtype != np.float32 or b.ndim == 0:
            return None
        self.constant_b_shape = tuple(b.shape)
        packed, layout = pack_streams(b[:, None] if b.ndim == 1 else b, self.trans_b)
        return upload_texels(device, packed, layout, STREAMS_TAG)

    def b_shape(self, b: PixelTensor) -> tuple[int, ...]:
        """B's shape as given (a packed constant's tensor has the packing's shape)."""
        return self.constant_b_shape if b.tag == STREAMS_TAG else tuple(b.shape)

    def draw_product(self, device: PixelDevice, a: PixelTensor, b: PixelTensor, p: Product, extra: dict,
                     epilogue: str, post: str | None) -> PixelTensor:
        """The product draw; a runtime B is first brought to the rows arrangement."""
        streams = b.tag == STREAMS_TAG
        if not streams:
            b = as_rows(device, b, p.b_batch + (p.k, p.n), transposed=self.trans_b)
        splits = choose_splits(p)
        if splits == 1:
            body = product_body(p, streams, 1, epilogue)
            return device.draw(p.out_shape, body, {"A": a, "B": b, **extra}, mode="texel", layout=p.layout,
                               post=post)
        parts = Layout(splits * p.rows, p.n, 1)
        partial = device.draw((splits * p.rows, p.n), product_body(p, streams, splits), {"A": a, "B": b},
                              mode="texel", layout=parts)
        return device.draw(p.out_shape, sum_body(p, splits, epilogue), {"P": partial, **extra},
                           mode="texel", layout=p.layout, post=post)


@pixel_kernel("MatMul")
class MatMul(_Product):
    """N-D matrix product with batch broadcasting and NumPy's 1-D operand rules."""

    def run(self, device: PixelDevice, inputs: list, post: str | None) -> list[PixelTensor]:
        a, b = inputs[0], inputs[1]
        p = matmul_product(a.shape, self.b_shape(b))
        a_rows = as_rows(device, a, p.a_batch + (p.m, p.k))
        return [self.draw_product(device, a_rows, b, p, {}, "", post)]


@pixel_kernel("Gemm")
class Gemm(_Product):
    """``alpha · A' @ B' + beta · C`` with optional transposes and a unidirectionally broadcast C."""

    def __init__(self, layer: Layer, op: Op):
        super().__init__(layer, op)
        self.trans_a = bool(int(op.attr("transA")))
        self.trans_b = bool(int(op.attr("transB")))
        self.alpha = float(op.attr("alpha"))
        self.beta = float(op.attr("beta"))

    def run(self, device: PixelDevice, inputs: list, post: str | None) -> list[PixelTensor]:
        a, b = inputs[0], inputs[1]
        c = inputs[2] if len(inputs) > 2 else None
        p = gemm_product(a.shape, self.b_shape(b), self.trans_a, self.trans_b)
        a_rows = as_rows(device, a, (p.m, p.k), transposed=self.trans_a)
        epilogue = "" if self.alpha == 1.0 else f"v *= {glsl_float(self.alpha)};"
        extra = {}
        if c is not None and self.beta != 0.0:  # beta 0 ignores C, NaNs included, as the CPU op does
            scale = "" if self.beta == 1.0 else f"{glsl_float(self.beta)} * "
            epilogue += f" v += {scale}{bias_fetch(c, p)};"
            extra["C"] = c
        return [self.draw_product(device, a_rows, b, p, extra, epilogue, post)]
