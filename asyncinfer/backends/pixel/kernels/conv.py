"""Convolution kernels, plus the sliding-window GLSL and channel-blocked helpers the pools share.

Every kernel here works on the channel-blocked NCHW layout (``outer=N, depth=C, inner=H·W``): a
texel is four channels of one pixel, so one fragment computes four output channels of one output
pixel. Conv weights are repacked once (``prepare_constant``) so that, per (tap, block of four
input channels), the inner loop reads one input texel and four weight texels and does a
``mat4 × vec4``: 16 multiply-adds for 5 fetches. Spatial ranks 1 to 3 share the same code: the
window loops are generated per spatial dimension, with compile-time bounds.

Texel fetches are what a convolution costs on llvmpipe, so 3x3 stride-1 convs with enough input
channels run as Winograd F(2x2, 3x3) instead: three draws (input transform, 16 small GEMMs,
output transform) doing 2.25 times fewer multiply-adds, each still 16 per 5 fetches.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ....model.ir import Layer
from ....ops.base import Op
from ....ops.windows import spatial_attrs, window_geometry
from ..layout import Layout, flat_layout
from .base import PixelKernel, pixel_kernel

if TYPE_CHECKING:
    from ..device import PixelDevice
    from ..storage import PixelTensor

#: Tag of conv weights uploaded in the packed arrangement of `pack_conv_weights`.
PACKED_TAG = "conv:packed-weights"
#: Spatial ranks the window code handles (1-D, 2-D and 3-D).
MAX_SPATIAL = 3


# -- layouts -----------------------------------------------------------------------------------------
def channel_layout(shape: Sequence[int]) -> Layout:
    """The channel-blocked layout of an ``(N, C, spatial...)`` tensor."""
    return Layout(int(shape[0]), int(shape[1]), math.prod(int(d) for d in shape[2:]))


def to_channel_blocked(device: "PixelDevice", x: "PixelTensor") -> "PixelTensor":
    """``x`` in the channel-blocked layout: itself, or a copy drawn from whatever layout it has
    (e.g. a last-axis-blocked rank-3 tensor)."""
    want = channel_layout(x.shape)
    if x.layout == want:
        return x
    return device.draw(x.shape, "float value(int i) { return X_at(i); }", {"X": x}, mode="value", layout=want)


def channel_vector(name: str, tensor: "PixelTensor", channels: int) -> str:
    """GLSL ``vec4`` of a per-channel vector input for the output depth block ``block``: one texel
    when it is stored blocked on its only axis, else four element reads (clamped into range; the
    padding lanes are discarded by the draw)."""
    if tensor.layout == Layout(1, channels, 1):
        return f"{name}_texel(block)"
    last = channels - 1
    return "vec4(" + ", ".join(f"{name}_at(min(4 * block + {k}, {last}))" for k in range(4)) + ")"


# -- sliding windows ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Window:
    """The geometry of a sliding window over the spatial dims, and its GLSL loops."""

    in_sp: tuple[int, ...]
    out_sp: tuple[int, ...]
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    begin: tuple[int, ...]
    end: tuple[int, ...]

    @classmethod
    def of(cls, op: Op, in_sp: Sequence[int], kernel: Sequence[int], ceil_mode: bool = False) -> "Window":
        """The window of ``op``'s strides, dilations, pads and auto_pad over ``in_sp``."""
        kernel = [int(k) for k in kernel]
        strides, dilations, pads = spatial_attrs(op, len(in_sp), kernel)
        begin, end, out = window_geometry(in_sp, kernel, strides, dilations, pads,
                                          op.attr("auto_pad", "NOTSET"), ceil_mode)
        as_ints = lambda v: tuple(int(a) for a in v)  # noqa: E731
        # A stride with one output position, a dilation with one tap, multiply only 0: 1 keeps
        # the GLSL ints in range (a stride of 2^40 is a compile error as a literal).
        strides = [s if o > 1 else 1 for s, o in zip(strides, out)]
        dilations = [d if k > 1 else 1 for d, k in zip(dilations, kernel)]
        return cls(as_ints(in_sp), as_ints(out), as_ints(kernel), as_ints(strides), as_ints(dilations),
                   as_ints(begin), as_ints(end))

    @property
    def taps(self) -> int:
        return math.prod(self.kernel)

    def leaves_input(self, d: int) -> bool:
        """Whether some window reaches outside the input on spatial dim ``d`` (so taps need a check)."""
        last = (self.out_sp[d] - 1) * self.strides[d] + (self.kernel[d] - 1) * self.dilations[d] - self.begin[d]
        return self.begin[d] > 0 or last >= self.in_sp[d]

    def full(self) -> bool:
        """Whether every window lies inside the input."""
        return not any(self.leaves_input(d) for d in range(len(self.in_sp)))

    def origin(self) -> str:
        """GLSL declaring ``s<d>``, the input coordinate of every window's first tap, from ``inner``."""
        lines, step = [], 1
        for d in reversed(range(len(self.out_sp))):
            coord = "inner" if step == 1 else f"(inner / {step})"
            if d > 0:
                coord = f"({coord} % {self.out_sp[d]})"
            lines.append(f"int s{d} = {coord} * {self.strides[d]} - {self.begin[d]};")
            step *= self.out_sp[d]
        return " ".join(reversed(lines))

    def loops(self, body: str, check: bool = True) -> str:
        """Nested loops over the taps around ``body``, which sees ``pix`` (the input pixel's flat
        spatial index) and ``tap`` (the tap's flat index). Taps outside the input are skipped when
        ``check`` (else the caller guarantees they do not occur, or wants them)."""
        n = len(self.kernel)
        opened, closing = [], ""
        for d in range(n):
            guard = (f" if (p{d} < 0 || p{d} >= {self.in_sp[d]}) continue;"
                     if check and self.leaves_input(d) else "")
            opened.append(f"for (int k{d} = 0; k{d} < {self.kernel[d]}; ++k{d}) {{ "
                          f"int p{d} = s{d} + k{d} * {self.dilations[d]};{guard}")
            closing += "}"
        pix = " + ".join(f"p{d} * {math.prod(self.in_sp[d + 1:])}" for d in range(n)) or "0"
        tap = "k0"
        for d in range(1, n):
            tap = f"({tap}) * {self.kernel[d]} + k{d}"
        inner = f"int pix = {pix}; int tap = {tap if n else '0'};\n{body}\n"
        return "\n".join(opened) + "\n" + inner + closing


# -- weights -----------------------------------------------------------------------------------------
def pack_conv_weights(w: np.ndarray, group: int) -> np.ndarray:
    """Conv weights ``(M, C/group, *kernel)`` as ``(ceil(M/4), taps, ceil(C_g/4), 4, 4)``.

    Element ``[ob, tap, cb, j, k]`` is ``w[4·ob + k, 4·cb + j, tap]`` (0 past the edges), so with a
    flat layout texel ``((ob·taps + tap)·CB + cb)·4 + j`` holds input channel ``4·cb + j``'s
    weights for the four output channels of block ``ob``: the column ``j`` of a ``mat4``.
    """
    m, cg = int(w.shape[0]), int(w.shape[1])
    taps = math.prod(w.shape[2:])
    mb, cb = -(-m // 4), -(-cg // 4)
    padded = np.zeros((mb * 4, cb * 4, taps), np.float32)
    padded[:m, :cg] = np.asarray(w, np.float32).reshape(m, cg, taps)
    # (ob, k, cb, j, tap) -> (ob, tap, cb, j, k)
    return np.ascontiguousarray(padded.reshape(mb, 4, cb, 4, taps).transpose(0, 4, 2, 3, 1))


def packed_shape(w_shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of `pack_conv_weights`'s result for weights of ``w_shape``."""
    return (-(-int(w_shape[0]) // 4), math.prod(int(d) for d in w_shape[2:]), -(-int(w_shape[1]) // 4), 4, 4)


def pack_weights_on_device(device: "PixelDevice", w: "PixelTensor") -> "PixelTensor":
    """`pack_conv_weights` as a draw, for weights computed at run time."""
    m, cg = int(w.shape[0]), int(w.shape[1])
    shape = packed_shape(w.shape)
    _, taps, cb, _, _ = shape
    body = f"""float value(int i) {{
    int k = i & 3; int j = (i >> 2) & 3; int q = i >> 4;
    int c = 4 * (q % {cb}) + j; q /= {cb};
    int tap = q % {taps}; int m = 4 * (q / {taps}) + k;
    return (m < {m} && c < {cg}) ? W_at((m * {cg} + c) * {taps} + tap) : 0.0;
}}"""
    return device.draw(shape, body, {"W": w}, mode="value", layout=flat_layout(math.prod(shape)))


# -- shader bodies -----------------------------------------------------------------------------------
def fetchers(*names: str) -> str:
    """GLSL ``vec4 <name>_fetch(int t)``: ``<name>_texel`` for indices known to be non-negative.
    Unsigned division by the (constant) width compiles to fewer instructions than the signed one,
    which matters in the inner loops: llvmpipe spends most of a convolution in texel fetches."""
    return "".join(f"vec4 {n}_fetch(int t) {{ uint u = uint(t); "
                   f"return texelFetch({n}, ivec2(int(u % uint({n}_W)), int(u / uint({n}_W))), 0); }}\n"
                   for n in names)


def blocked_body(win: Window, cb: int, group_blocks: str, bias: str) -> str:
    """Dense (or 4-aligned grouped) conv: per tap and input block, ``mat4 × vec4``.

    ``cb`` is the number of input blocks one output block reads, ``group_blocks`` a GLSL
    expression of ``block``: the first of them.
    """
    step = f"""int x = xbase + pix; int w = (wbase + tap) * {4 * cb};
for (int c = 0; c < {cb}; ++c) {{
    acc += mat4(W_fetch(w), W_fetch(w + 1), W_fetch(w + 2), W_fetch(w + 3)) * X_fetch(x);
    x += X_I; w += 4;
}}"""
    return fetchers("W", "X") + f"""vec4 texel(int t, int outer, int block, int inner) {{
    vec4 acc = {bias};
    int xbase = (outer * X_B + {group_blocks}) * X_I; int wbase = block * {win.taps};
    {win.origin()}
{win.loops(step)}
    return acc;
}}"""


def depthwise_body(win: Window, bias: str) -> str:
    """One input channel per output channel (group = C = M): input block = output block."""
    step = "acc += W_fetch((wbase + tap) * 4) * X_fetch(xbase + pix);"
    return fetchers("W", "X") + f"""vec4 texel(int t, int outer, int block, int inner) {{
    vec4 acc = {bias};
    int xbase = (outer * X_B + block) * X_I; int wbase = block * {win.taps};
    {win.origin()}
{win.loops(step)}
    return acc;
}}"""


def lane_body(win: Window, channels: int, cg: int, mg: int, bias: str) -> str:
    """Any grouping: each output lane reads its own group's input channels one at a time."""
    cb = -(-cg // 4)
    step = f"""int w = (wbase + tap) * {4 * cb};
for (int c = 0; c < {cg}; ++c) {{
    ivec4 ch = min(first + c, ivec4({channels - 1}));
    ivec4 xt = ((outer * X_B) + (ch >> 2)) * X_I + pix;
    ivec4 lane = ch & 3;
    vec4 x = vec4(X_texel(xt.x)[lane.x], X_texel(xt.y)[lane.y], X_texel(xt.z)[lane.z], X_texel(xt.w)[lane.w]);
    acc += W_texel(w + c) * x;
}}"""
    return f"""vec4 texel(int t, int outer, int block, int inner) {{
    vec4 acc = {bias};
    ivec4 first = ((ivec4(4 * block) + ivec4(0, 1, 2, 3)) / {mg}) * {cg};
    int wbase = block * {win.taps};
    {win.origin()}
{win.loops(step)}
    return acc;
}}"""


# -- Winograd F(2x2, 3x3) ------------------------------------------------------------------------------
# Y = Aᵀ [(G g Gᵀ) ⊙ (Bᵀ d B)] A computes a 2x2 output tile from a 4x4 input patch with 16
# multiplies per channel pair instead of 36: 2.25 times fewer multiply-adds for 3x3 stride-1 convs,
# whose cost on llvmpipe is the texel fetches of the multiply-adds. The constants are 0, ±1 and
# ±1/2, so the rounding stays that of float32 sums (unlike larger Winograd tiles).
WINOGRAD_G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])
#: Tag of conv weights packed as Winograd transforms (``G g Gᵀ``, 16 positions as the "taps").
WINOGRAD_TAG = "conv:winograd-weights"
#: Fewest input channels for which the Winograd transforms pay for themselves.
WINOGRAD_MIN_CHANNELS = 8


def winograd_eligible(op: Op, w_shape: Sequence[int], group: int) -> bool:
    """3x3, stride 1, no dilation, no groups, enough channels: the convs Winograd speeds up."""
    if group != 1 or len(w_shape) != 4 or tuple(w_shape[2:]) != (3, 3) or int(w_shape[1]) < WINOGRAD_MIN_CHANNELS:
        return False
    kernel = op.attr("kernel_shape", None)
    return ((kernel is None or list(kernel) == [3, 3])
            and all(int(v) == 1 for v in (op.attr("strides", None) or [1, 1]))
            and all(int(v) == 1 for v in (op.attr("dilations", None) or [1, 1])))


def winograd_weights(w: np.ndarray) -> np.ndarray:
    """``G g Gᵀ`` for every (output, input) channel pair: ``(M, C, 4, 4)``, computed in float64."""
    g = np.asarray(w, np.float64)
    return np.einsum("ia,mcab,jb->mcij", WINOGRAD_G, g, WINOGRAD_G).astype(np.float32)


def _pair(index: str, var: str) -> str:
    """GLSL: the two patch rows (or columns) that Winograd row ``index`` of ``Bᵀ`` combines, and
    their signs: ``Bᵀ`` rows are (1,0,-1,0), (0,1,1,0), (0,-1,1,0), (0,1,0,-1)."""
    return (f"ivec2 {var} = ivec2({index} == 0 ? 0 : 1, {index} == 3 ? 3 : 2); "
            f"vec2 {var}s = vec2({index} == 2 ? -1.0 : 1.0, ({index} == 0 || {index} == 3) ? -1.0 : 1.0);")


def winograd_input_body(win: Window, tiles: int, tiles_w: int) -> str:
    """``Bᵀ d B``: texel ((image·16 + position)·tiles + tile, channel block), so that the product
    reads the channel blocks of one tile and position from consecutive texels; each position of
    the 4x4 transform combines four input pixels."""
    height, width = win.in_sp
    terms = []
    for u in range(2):
        for v in range(2):
            inside = f"r[{u}] >= 0 && r[{u}] < {height} && c[{v}] >= 0 && c[{v}] < {width}"
            terms.append(f"if ({inside}) acc += (rs[{u}] * cs[{v}]) * X_texel(base + r[{u}] * {width} + c[{v}]);")
    return f"""vec4 texel(int t, int outer, int block, int inner) {{
    int tile = outer % {tiles}; int q = outer / {tiles};
    int p = q % 16; int i = p >> 2; int j = p & 3;
    {_pair("i", "r")} {_pair("j", "c")}
    r += (tile / {tiles_w}) * 2 - {win.begin[0]}; c += (tile % {tiles_w}) * 2 - {win.begin[1]};
    int base = ((q / 16) * X_B + block) * X_I;
    vec4 acc = vec4(0.0);
    {" ".join(terms)}
    return acc;
}}"""


def winograd_product_body(cb: int) -> str:
    """The 16 per-position products ``U_p · V_p``: a 1x1 conv per position, ``mat4 × vec4`` per
    input block; output texel (image·16 + position, output block, tile)."""
    return fetchers("W", "V") + f"""vec4 texel(int t, int outer, int block, int inner) {{
    vec4 acc = vec4(0.0);
    int x = (outer * OUT_I + inner) * {cb}; int w = (block * 16 + outer % 16) * {4 * cb};
    for (int c = 0; c < {cb}; ++c) {{
        acc += mat4(W_fetch(w), W_fetch(w + 1), W_fetch(w + 2), W_fetch(w + 3)) * V_fetch(x + c);
        w += 4;
    }}
    return acc;
}}"""


def winograd_output_body(out_w: int, tiles_w: int, bias: str) -> str:
    """``Aᵀ m A`` plus bias: output pixel (r, s) of its tile sums positions (r+k, s+l), k, l < 3,
    with signs from ``Aᵀ`` rows (1,1,1,0) and (0,1,-1,-1)."""
    terms = []
    for k in range(3):
        for l in range(3):
            sign = "" if k == 0 and l == 0 else (f"sr{k}" if l == 0 else (f"ss{l}" if k == 0 else f"sr{k} * ss{l}"))
            fetch = f"M_texel(base + ({(k * 4 + l)} + r * 4 + s) * M_B * M_I)"
            terms.append(f"acc += {sign + ' * ' if sign else ''}{fetch};")
    return f"""vec4 texel(int t, int outer, int block, int inner) {{
    int oy = inner / {out_w}; int ox = inner % {out_w}; int r = oy & 1; int s = ox & 1;
    float sr1 = r == 0 ? 1.0 : -1.0; float sr2 = sr1; float ss1 = s == 0 ? 1.0 : -1.0; float ss2 = ss1;
    int base = ((outer * 16) * M_B + block) * M_I + (oy >> 1) * {tiles_w} + (ox >> 1);
    vec4 acc = {bias};
    {" ".join(terms)}
    return acc;
}}"""


@dataclass(frozen=True)
class ConvPlan:
    """What one input shape needs: the shader bodies (one direct, or the three Winograd stages)
    and the output shape."""

    bodies: tuple[str, ...]
    out_shape: tuple[int, ...]
    tiles: int = 0  # Winograd: output tiles per image


@pixel_kernel("Conv")
class Conv(PixelKernel):
    """N-D convolution (1 to 3 spatial dims) with strides, dilations, pads/auto_pad, groups
    (depthwise included), optional bias and fused activations.

    Weights given as initializers are packed on the host once (as Winograd transforms for the 3x3
    stride-1 convs that qualify); weights computed at run time are packed by one extra draw per
    run and always take the direct path.
    """

    def __init__(self, layer: Layer, op: Op):
        super().__init__(layer, op)
        self.group = int(op.attr("group"))
        self._plans: dict[tuple, ConvPlan] = {}
        self._weight_shape: tuple[int, ...] = ()

    def supports(self, types: Mapping[str, np.dtype | None]) -> bool:
        kernel = self.op.attr("kernel_shape", None)
        if kernel is not None and not 1 <= len(kernel) <= MAX_SPATIAL:
            return False
        return super().supports(types)

    def prepare_constant(self, device: "PixelDevice", index: int, array: np.ndarray) -> "PixelTensor | None":
        if index != 1 or not 3 <= np.ndim(array) <= MAX_SPATIAL + 2:
            return None
        self._weight_shape = tuple(np.shape(array))  # the packed tensor's shape no longer says it
        if winograd_eligible(self.op, array.shape, self.group):
            packed, tag = pack_conv_weights(winograd_weights(array), 1), WINOGRAD_TAG
        else:
            packed, tag = pack_conv_weights(array, self.group), PACKED_TAG
        return device.upload(packed, layout=flat_layout(packed.size), tag=tag)

    def run(self, device: "PixelDevice", inputs: list, post: str | None) -> list["PixelTensor"]:
        x, w = inputs[0], inputs[1]
        b = inputs[2] if len(inputs) > 2 else None
        if not 1 <= len(x.shape) - 2 <= MAX_SPATIAL:
            raise ValueError(f"Conv on a rank-{len(x.shape)} input: only 1 to {MAX_SPATIAL} spatial dims run here")
        packed = w.tag in (PACKED_TAG, WINOGRAD_TAG)
        plan = self._plan(tuple(x.shape), self._weight_shape if packed else tuple(w.shape), b, w.tag == WINOGRAD_TAG)
        out_layout = channel_layout(plan.out_shape)
        if math.prod(plan.out_shape) == 0:
            return [device.empty(plan.out_shape, layout=out_layout)]
        x = to_channel_blocked(device, x)
        bias = {} if b is None else {"B": b}
        if w.tag == WINOGRAD_TAG:
            return [self._winograd(device, plan, x, w, bias, post)]
        w = w if packed else pack_weights_on_device(device, w)
        return [device.draw(plan.out_shape, plan.bodies[0], {"X": x, "W": w, **bias}, mode="texel",
                            layout=out_layout, post=post)]

    @staticmethod
    def _winograd(device: "PixelDevice", plan: ConvPlan, x: "PixelTensor", w: "PixelTensor",
                  bias: dict, post: str | None) -> "PixelTensor":
        """Three draws: input transform, the 16 per-position products, output transform."""
        to_tiles, product, from_tiles = plan.bodies
        n, c = x.shape[:2]
        m, rows = plan.out_shape[1], n * 16 * plan.tiles
        v = device.draw((rows, c), to_tiles, {"X": x}, mode="texel", layout=Layout(rows, c, 1))
        products = device.draw((n * 16, m, plan.tiles), product, {"V": v, "W": w}, mode="texel",
                               layout=Layout(n * 16, m, plan.tiles))
        return device.draw(plan.out_shape, from_tiles, {"M": products, **bias}, mode="texel",
                           layout=channel_layout(plan.out_shape), post=post)

    def _plan(self, x_shape: tuple[int, ...], w_shape: tuple[int, ...], b: "PixelTensor | None",
              winograd: bool) -> ConvPlan:
        """The plan for this input shape (cached: the GLSL depends on the shapes)."""
        key = (x_shape, w_shape, None if b is None else b.layout, winograd)
        if key not in self._plans:
            self._plans[key] = self._build(x_shape, w_shape, b, winograd)
        return self._plans[key]

    def _build(self, x_shape: tuple[int, ...], w_shape: tuple[int, ...], b: "PixelTensor | None",
               winograd: bool) -> ConvPlan:
        n, channels = x_shape[:2]
        m, cg = int(w_shape[0]), int(w_shape[1])
        group = self.group
        if channels != cg * group or m % group:
            raise ValueError(f"Conv: input channels {channels}, weights {list(w_shape)} and group {group} disagree")
        win = Window.of(self.op, x_shape[2:], self.op.attr("kernel_shape", None) or w_shape[2:])
        out_shape = (int(n), m) + win.out_sp
        bias = "vec4(0.0)" if b is None else channel_vector("B", b, m)
        if winograd:
            tiles_h, tiles_w = (-(-o // 2) for o in win.out_sp)
            tiles = tiles_h * tiles_w
            bodies = (winograd_input_body(win, tiles, tiles_w), winograd_product_body(-(-cg // 4)),
                      winograd_output_body(win.out_sp[1], tiles_w, bias))
            return ConvPlan(bodies, out_shape, tiles)
        return ConvPlan((direct_body(win, channels, cg, m // group, group, bias),), out_shape)


def direct_body(win: Window, channels: int, cg: int, mg: int, group: int, bias: str) -> str:
    """The direct conv's shader body for this grouping."""
    if group == 1:
        return blocked_body(win, -(-cg // 4), "0", bias)
    if cg == 1 and mg == 1:
        return depthwise_body(win, bias)
    if cg % 4 == 0 and mg % 4 == 0:  # every output block in one group, whose inputs are whole blocks
        return blocked_body(win, cg // 4, f"(block / {mg // 4}) * {cg // 4}", bias)
    return lane_body(win, channels, cg, mg, bias)
