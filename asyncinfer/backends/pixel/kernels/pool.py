"""Pooling and per-channel normalization kernels: MaxPool, AveragePool, GlobalAveragePool,
GlobalMaxPool, LRN, BatchNormalization (inference) and InstanceNormalization.

They all work on ``vec4``s of channels in the channel-blocked NCHW layout (see conv.py): a window
or a reduction over pixels is the same code for four channels at once.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from ..layout import Layout
from .base import PixelKernel, glsl_float, pixel_kernel
from .conv import MAX_SPATIAL, Window, channel_layout, channel_vector, fetchers, to_channel_blocked

if TYPE_CHECKING:
    from ..device import PixelDevice
    from ..storage import PixelTensor

#: Pixels one fragment reduces in a global reduction; longer planes are reduced in stages, so
#: a big plane is spread over many fragments (and threads) instead of a few very long loops.
REDUCE_CHUNK = 256
NEG_INF = glsl_float(-math.inf)


# -- windowed pools -----------------------------------------------------------------------------------
def window_count(win: Window, include_pad: bool) -> str:
    """GLSL declaring ``count``: how many taps of this fragment's window are counted by an average
    (inside the input, or inside input plus explicit pads with ``include_pad``)."""
    lines = ["float count = 1.0;"]
    for d in range(len(win.kernel)):
        lo, hi = (-win.begin[d], win.in_sp[d] + win.end[d]) if include_pad else (0, win.in_sp[d])
        lines.append(f"{{ int n = 0; for (int k = 0; k < {win.kernel[d]}; ++k) {{ "
                     f"int p = s{d} + k * {win.dilations[d]}; n += int(p >= {lo} && p < {hi}); }} "
                     f"count *= float(n); }}")
    return "\n    ".join(lines)


def pool_body(win: Window, kind: str, include_pad: bool = False) -> str:
    """Max or average over each window, four channels at a time; taps outside the input are
    skipped (the -inf or 0 padding of the CPU op)."""
    if kind == "max":
        start, step, finish = f"vec4({NEG_INF})", "acc = max(acc, X_fetch(base + pix));", "acc"
    else:
        start, step = "vec4(0.0)", "acc += X_fetch(base + pix);"
        finish = f"acc * {glsl_float(1.0 / win.taps)}"
    count = ""
    if kind == "average" and not win.full():
        count, finish = window_count(win, include_pad), "acc / count"
    return fetchers("X") + f"""vec4 texel(int t, int outer, int block, int inner) {{
    vec4 acc = {start};
    int base = (outer * X_B + block) * X_I;
    {win.origin()}
{win.loops(step)}
    {count}
    return {finish};
}}"""


class _WindowPool(PixelKernel):
    """Shared planning and drawing of MaxPool and AveragePool."""

    kind = ""

    def supports(self, types: Mapping[str, np.dtype | None]) -> bool:
        kernel = self.op.attr("kernel_shape", None)
        if kernel is None or not 1 <= len(kernel) <= MAX_SPATIAL:
            return False
        if len(self.layer.outputs) > 1 and any(self.layer.outputs[1:]):  # MaxPool's Indices
            return False
        return super().supports(types)

    def run(self, device: "PixelDevice", inputs: list, post: str | None) -> list["PixelTensor"]:
        x = inputs[0]
        win = Window.of(self.op, x.shape[2:], self.op.attr("kernel_shape"), bool(self.op.attr("ceil_mode", 0)))
        out_shape = tuple(x.shape[:2]) + win.out_sp
        if math.prod(out_shape) == 0:
            return [device.empty(out_shape, layout=channel_layout(out_shape))]
        body = pool_body(win, self.kind, bool(self.op.attr("count_include_pad", 0)))
        return [device.draw(out_shape, body, {"X": to_channel_blocked(device, x)}, mode="texel",
                            layout=channel_layout(out_shape), post=post)]


@pixel_kernel("MaxPool")
class MaxPool(_WindowPool):
    """Max over 1-D to 3-D windows (strides, dilations, pads/auto_pad, ceil_mode); without the
    Indices output."""

    kind = "max"


@pixel_kernel("AveragePool")
class AveragePool(_WindowPool):
    """Mean over 1-D to 3-D windows, with count_include_pad, ceil_mode and dilations."""

    kind = "average"


# -- reductions over the pixels of each channel -------------------------------------------------------
def reduce_pixels(device: "PixelDevice", x: "PixelTensor", combine: str, element: str = "v", finish: str = "acc",
                  extra: dict | None = None, post: str | None = None) -> "PixelTensor":
    """``(N, C, 1)``: ``combine`` (``"sum"`` or ``"max"``) of ``element`` (GLSL of the ``vec4 v``
    read at each pixel) over the pixels of each channel of the channel-blocked ``x``, then
    ``finish`` (of ``acc``). Long planes are reduced in chunks of `REDUCE_CHUNK`, then the
    partial results again. ``extra`` inputs are per-(n, channel block) ``vec4``s that ``element``
    reads at texel ``outer * X_B + block`` (layout ``(N, C, 1)``)."""
    n, c, pixels = x.layout.outer, x.layout.depth, x.layout.inner
    start = f"vec4({NEG_INF})" if combine == "max" else "vec4(0.0)"
    merge = "acc = max(acc, e);" if combine == "max" else "acc += e;"
    while True:
        chunks = max(1, -(-pixels // REDUCE_CHUNK))
        last = chunks == 1
        body = f"""vec4 texel(int t, int outer, int block, int inner) {{
    vec4 acc = {start};
    int base = (outer * X_B + block) * X_I + inner * {REDUCE_CHUNK};
    for (int j = 0; j < {min(pixels, REDUCE_CHUNK)}; ++j) {{
        if (inner * {REDUCE_CHUNK} + j >= X_I) break;
        vec4 v = X_texel(base + j); vec4 e = {element}; {merge}
    }}
    return {finish if last else "acc"};
}}"""
        layout = Layout(n, c, chunks)
        x = device.draw((n, c, chunks), body, {"X": x, **(extra or {})}, mode="texel", layout=layout,
                        post=post if last else None)
        if last:
            return x
        pixels, element, extra = chunks, "v", None  # the partial results combine as they are


class _GlobalPool(PixelKernel):
    """Shared drawing of the global pools: one reduction over each channel's pixels."""

    def run(self, device: "PixelDevice", inputs: list, post: str | None) -> list["PixelTensor"]:
        x = inputs[0]
        out_shape = tuple(x.shape[:2]) + (1,) * (len(x.shape) - 2)
        pixels = math.prod(x.shape[2:])
        if self.layer.op_type == "GlobalMaxPool":
            y = reduce_pixels(device, to_channel_blocked(device, x), "max", post=post)
        else:
            y = reduce_pixels(device, to_channel_blocked(device, x), "sum", finish=f"acc / {float(pixels)}", post=post)
        return [y.view(out_shape)]


@pixel_kernel("GlobalAveragePool")
class GlobalAveragePool(_GlobalPool):
    """Mean over all spatial dims, per channel."""


@pixel_kernel("GlobalMaxPool")
class GlobalMaxPool(_GlobalPool):
    """Max over all spatial dims, per channel."""


# -- normalization ------------------------------------------------------------------------------------
def lrn_body(size: int, alpha: float, beta: float, bias: float, channels: int) -> str:
    """LRN: each lane sums the squares of its ``size`` channel neighbours (of ``channels``). The
    neighbours of lane ``k`` of block ``b`` lie in blocks ``b + floor((k + j) / 4)`` at lanes
    ``(k + j) & 3``: known when compiling, so the blocks are fetched once and the sums are unrolled."""
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    lo, hi = min(lo, channels - 1), min(hi, channels - 1)  # farther channels do not exist: unroll no more
    first, last = (-lo) // 4, (3 + hi) // 4
    fetch = [f"vec4 q{o - first} = (block + ({o}) >= 0 && block + ({o}) < X_B) ? "
             f"X_texel(t + ({o}) * X_I) : vec4(0.0); q{o - first} *= q{o - first};"
             for o in range(first, last + 1)]
    lanes = []
    for k in range(4):
        terms = [f"q{(k + j) // 4 - first}[{(k + j) % 4}]" for j in range(-lo, hi + 1)]
        lanes.append(" + ".join(terms))
    scale = alpha / size
    return f"""vec4 texel(int t, int outer, int block, int inner) {{
    {" ".join(fetch)}
    vec4 s = vec4({", ".join(lanes)}) * {glsl_float(scale)} + {glsl_float(bias)};
    return X_texel(t) * pow(s, vec4({glsl_float(-beta)}));
}}"""


@pixel_kernel("LRN")
class LRN(PixelKernel):
    """Local response normalization across channels."""

    def run(self, device: "PixelDevice", inputs: list, post: str | None) -> list["PixelTensor"]:
        x = to_channel_blocked(device, inputs[0])
        body = lrn_body(int(self.op.attr("size")), float(self.op.attr("alpha")),
                        float(self.op.attr("beta")), float(self.op.attr("bias")), int(x.shape[1]))
        return [device.draw(x.shape, body, {"X": x}, mode="texel", layout=x.layout, post=post)]


@pixel_kernel("BatchNormalization")
class BatchNormalization(PixelKernel):
    """Inference-mode batch norm ``x · a + b`` with ``a = scale / sqrt(var + eps)`` and
    ``b = bias - mean · a``, on ``vec4``s of channels (or element-wise for other layouts); the
    output keeps the input's layout."""

    def supports(self, types: Mapping[str, np.dtype | None]) -> bool:
        # training mode (the CPU op's ``training``) normalizes with the batch's statistics: not here
        return (not self.op.training and len([o for o in self.layer.outputs if o]) == 1  # type: ignore[attr-defined]
                and super().supports(types))

    def run(self, device: "PixelDevice", inputs: list, post: str | None) -> list["PixelTensor"]:
        x, scale, bias, mean, var = inputs[:5]
        eps = glsl_float(float(self.op.attr("epsilon")))
        bound = {"X": x, "S": scale, "C": bias, "M": mean, "V": var}
        channels = x.shape[1]
        if x.layout == channel_layout(x.shape):
            vec = {k: channel_vector(k, t, channels) for k, t in bound.items() if k != "X"}
            body = f"""vec4 texel(int t, int outer, int block, int inner) {{
    vec4 a = {vec["S"]} / sqrt({vec["V"]} + {eps});
    return X_texel(t) * a + ({vec["C"]} - {vec["M"]} * a);
}}"""
            return [device.draw(x.shape, body, bound, mode="texel", layout=x.layout, post=post)]
        pixels = math.prod(x.shape[2:])
        body = f"""float value(int i) {{
    int c = (i / {pixels}) % {channels};
    float a = S_at(c) / sqrt(V_at(c) + {eps});
    return X_at(i) * a + (C_at(c) - M_at(c) * a);
}}"""
        return [device.draw(x.shape, body, bound, mode="value", layout=x.layout, post=post)]


@pixel_kernel("InstanceNormalization")
class InstanceNormalization(PixelKernel):
    """Per (image, channel) normalization over the spatial dims: mean, then the variance of the
    centred values (two reductions, as the CPU op), then the scaled and shifted output."""

    def run(self, device: "PixelDevice", inputs: list, post: str | None) -> list["PixelTensor"]:
        x, scale, bias = inputs[:3]
        if len(x.shape) < 3:
            raise ValueError(f"InstanceNormalization needs spatial dims, got shape {list(x.shape)}")
        x = to_channel_blocked(device, x)
        pixels = float(x.layout.inner)
        mean = reduce_pixels(device, x, "sum", finish=f"acc / {pixels}")
        centred = "(v - M_texel(outer * X_B + block)) * (v - M_texel(outer * X_B + block))"
        var = reduce_pixels(device, x, "sum", element=centred, finish=f"acc / {pixels}", extra={"M": mean})
        channels = x.shape[1]
        eps = glsl_float(float(self.op.attr("epsilon")))
        body = f"""vec4 texel(int t, int outer, int block, int inner) {{
    int s = outer * X_B + block;
    vec4 a = {channel_vector("S", scale, channels)} / sqrt(V_texel(s) + {eps});
    return X_texel(t) * a + ({channel_vector("C", bias, channels)} - M_texel(s) * a);
}}"""
        bound = {"X": x, "S": scale, "C": bias, "M": mean, "V": var}
        return [device.draw(x.shape, body, bound, mode="texel", layout=x.layout, post=post)]
