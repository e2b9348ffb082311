"""GLSL for one draw: the inputs' fetch functions, the output texel loop, and the program cache.

A kernel supplies the *body* of a fragment shader in one of two forms:

- ``value`` mode: ``float value(int i)`` returns output element ``i`` (its C-order flat index).
  The generated ``main`` calls it for the four lanes of the texel being drawn. Any output layout
  works, so this is the general form (broadcasting, gathers, reductions).
- ``texel`` mode: ``vec4 texel(int t, int outer, int block, int inner)`` returns texel ``t`` of the output
  whole, where ``(outer, block, inner)`` are its outer index, depth block and inner index (see layout.py).
  Kernels use it when their inputs share the output's layout, or to work on ``vec4``s of channels.

Every input ``X`` gets ``vec4 X_texel(int t)`` (one texel) and ``float X_at(int i)`` (element
``i`` by flat index, whatever the layout), plus constants ``X_W`` (texture width), ``X_D``,
``X_B`` (blocks) and ``X_I``. Shapes are compile-time constants, so programs are cached by their
source, i.e. by op, attributes and shape class; the GLSL compiler folds the index arithmetic.
Padding lanes (past the depth) are always written as 0, which reductions over the depth rely on.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .layout import Layout

# Overloads for float and vec4 of what GLSL lacks or gets wrong at the edges; in every shader,
# so element-wise expressions and fused activations can use them anywhere. With GLSL's built-ins
# they implement the device dialect of asyncinfer.ops.pointwise.DIALECT (the element-wise table);
# comparisons and pick also take a float second/third argument, so ``ge(x, 0.0)`` and
# ``pick(c, x, 0.0)`` work on a vec4 x.
HELPERS = """
float lt(float a, float b) { return float(a < b); }  vec4 lt(vec4 a, vec4 b) { return vec4(lessThan(a, b)); }
float le(float a, float b) { return float(a <= b); } vec4 le(vec4 a, vec4 b) { return vec4(lessThanEqual(a, b)); }
float gt(float a, float b) { return float(a > b); }  vec4 gt(vec4 a, vec4 b) { return vec4(greaterThan(a, b)); }
float ge(float a, float b) { return float(a >= b); } vec4 ge(vec4 a, vec4 b) { return vec4(greaterThanEqual(a, b)); }
float eq(float a, float b) { return float(a == b); } vec4 eq(vec4 a, vec4 b) { return vec4(equal(a, b)); }
vec4 lt(vec4 a, float b) { return lt(a, vec4(b)); } vec4 le(vec4 a, float b) { return le(a, vec4(b)); }
vec4 gt(vec4 a, float b) { return gt(a, vec4(b)); } vec4 ge(vec4 a, float b) { return ge(a, vec4(b)); }
vec4 eq(vec4 a, float b) { return eq(a, vec4(b)); }
float pick(float c, float a, float b) { return c != 0.0 ? a : b; }
vec4 pick(vec4 c, vec4 a, vec4 b) { return mix(b, a, notEqual(c, vec4(0.0))); }
vec4 pick(vec4 c, vec4 a, float b) { return pick(c, a, vec4(b)); }
vec4 pick(vec4 c, float a, vec4 b) { return pick(c, vec4(a), b); }
vec4 pick(vec4 c, float a, float b) { return pick(c, vec4(a), vec4(b)); }
float is_nan(float x) { return float(isnan(x)); } vec4 is_nan(vec4 x) { return vec4(isnan(x)); }
// tanh through exp, saturating instead of inf/inf for large |x|
float tanh_(float x) { return 1.0 - 2.0 / (exp(2.0 * x) + 1.0); }
vec4 tanh_(vec4 x) { return 1.0 - 2.0 / (exp(2.0 * x) + 1.0); }
float sinh_(float x) { return 0.5 * (exp(x) - exp(-x)); } vec4 sinh_(vec4 x) { return 0.5 * (exp(x) - exp(-x)); }
float cosh_(float x) { return 0.5 * (exp(x) + exp(-x)); } vec4 cosh_(vec4 x) { return 0.5 * (exp(x) + exp(-x)); }
float expm1(float x) { return exp(x) - 1.0; } vec4 expm1(vec4 x) { return exp(x) - 1.0; }
float softplus(float x) { return max(x, 0.0) + log(1.0 + exp(-abs(x))); }
vec4 softplus(vec4 x) { return max(x, 0.0) + log(1.0 + exp(-abs(x))); }
// erf: Abramowitz & Stegun 7.1.26 refined (|error| < 1.5e-7)
float erf_(float x) {
    float t = 1.0 / (1.0 + 0.3275911 * abs(x));
    float y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * exp(-x * x);
    return sign(x) * y;
}
vec4 erf_(vec4 x) { return vec4(erf_(x.x), erf_(x.y), erf_(x.z), erf_(x.w)); }
// ONNX Pow: negative bases with integral exponents are defined
float pow_(float a, float b) {
    float m = pow(abs(a), b);
    if (a < 0.0 && floor(b) == b) return mod(b, 2.0) == 1.0 ? -m : m;
    return (a < 0.0) ? uintBitsToFloat(0x7fc00000u) : (a == 0.0 && b == 0.0 ? 1.0 : m);
}
vec4 pow_(vec4 a, vec4 b) { return vec4(pow_(a.x, b.x), pow_(a.y, b.y), pow_(a.z, b.z), pow_(a.w, b.w)); }
float relu(float x) { return isnan(x) ? x : max(x, 0.0); }
vec4 relu(vec4 x) { return mix(max(x, 0.0), x, isnan(x)); }
// NumPy's maximum, minimum and clip: a NaN operand gives NaN (GLSL leaves min/max at NaN
// undefined; llvmpipe returns the other operand). The element-wise table's min/max/clamp are
// drawn with these (kernels/elementwise.py).
float max_(float a, float b) { return isnan(a) || isnan(b) ? a + b : max(a, b); }
vec4 max_(vec4 a, vec4 b) { return mix(max(a, b), a + b, bvec4(vec4(isnan(a)) + vec4(isnan(b)))); }
vec4 max_(vec4 a, float b) { return max_(a, vec4(b)); }
float min_(float a, float b) { return isnan(a) || isnan(b) ? a + b : min(a, b); }
vec4 min_(vec4 a, vec4 b) { return mix(min(a, b), a + b, bvec4(vec4(isnan(a)) + vec4(isnan(b)))); }
vec4 min_(vec4 a, float b) { return min_(a, vec4(b)); }
float clamp_(float x, float lo, float hi) { return min_(max_(x, lo), hi); }
vec4 clamp_(vec4 x, float lo, float hi) { return min_(max_(x, lo), hi); }
// A float constant of the host (an attribute, a fill value) by its bits: how kernels/base.py's
// glsl_float writes zeros, infinities and NaN. OR-ing in a uniform that is never set (GL links
// uniforms as 0) hides the value from the compiler, which would fold ``0.0 * x`` to 0 (NaN on the
// CPU for an infinite x) and has no literal for inf or NaN.
uniform uint opaque_zero;
float opaque(uint bits) { return uintBitsToFloat(bits | opaque_zero); }
"""

VERTEX_SHADER = """#version 330
// One triangle that covers the viewport; no vertex buffer needed.
void main() {
    vec2 corner = vec2(float((gl_VertexID << 1) & 2), float(gl_VertexID & 2));
    gl_Position = vec4(corner * 2.0 - 1.0, 0.0, 1.0);
}
"""


def input_declarations(name: str, layout: Layout, width: int) -> str:
    """Sampler and fetch helpers of the input ``name``."""
    lines = [
        f"uniform sampler2D {name};",
        f"const int {name}_W = {width}; const int {name}_D = {layout.depth}; "
        f"const int {name}_B = {layout.blocks}; const int {name}_I = {layout.inner};",
        f"vec4 {name}_texel(int t) {{ return texelFetch({name}, ivec2(t % {name}_W, t / {name}_W), 0); }}",
    ]
    if layout.inner == 1:
        lines.append(f"float {name}_at(int i) {{ int d = i % {name}_D; int o = i / {name}_D; "
                     f"return {name}_texel(o * {name}_B + (d >> 2))[d & 3]; }}")
    else:
        lines.append(f"float {name}_at(int i) {{ int r = i % {name}_I; int q = i / {name}_I; "
                     f"int d = q % {name}_D; int o = q / {name}_D; "
                     f"return {name}_texel((o * {name}_B + (d >> 2)) * {name}_I + r)[d & 3]; }}")
    return "\n".join(lines)


def fragment_source(inputs: Sequence[tuple[str, Layout, int]], out: Layout, width: int, body: str,
                    mode: str, post: str | None = None) -> str:
    """The whole fragment shader. ``post`` is a GLSL expression of ``v`` (a vec4) applied to the
    result, e.g. a fused activation ``max(v, 0.0)``."""
    decls = "\n".join(input_declarations(name, layout, w) for name, layout, w in inputs)
    if mode == "value":
        compute = "\n".join(
            f"    if (4 * b + {k} < OUT_D) v[{k}] = value(base + {k} * OUT_I);" for k in range(4))
        compute = f"    int base = (o * OUT_D + 4 * b) * OUT_I + r;\n    vec4 v = vec4(0.0);\n{compute}"
    elif mode == "texel":
        compute = "    vec4 v = texel(t, o, b, r);"
    else:
        raise ValueError(f"unknown shader mode {mode!r}")
    if post:
        compute += f"\n    v = {post};"
    if out.depth % 4:  # keep the padding lanes at 0
        compute += "\n    v = mix(vec4(0.0), v, lessThan(ivec4(4 * b) + ivec4(0, 1, 2, 3), ivec4(OUT_D)));"
    return f"""#version 330
out vec4 result;
const int OUT_W = {width}; const int OUT_T = {out.texels};
const int OUT_D = {out.depth}; const int OUT_B = {out.blocks}; const int OUT_I = {out.inner};
{HELPERS}
{decls}
{body}
void main() {{
    ivec2 p = ivec2(gl_FragCoord.xy);
    int t = p.y * OUT_W + p.x;
    if (t >= OUT_T) {{ result = vec4(0.0); return; }}
    int r = t % OUT_I; int q = t / OUT_I; int b = q % OUT_B; int o = q / OUT_B;
{compute}
    result = v;
}}
"""


class ProgramCache:
    """Compiled programs by source (so by op and shape class), each with its empty vertex array."""

    def __init__(self, ctx: Any):
        self._ctx = ctx
        self._programs: dict[str, tuple[Any, Any]] = {}
        self.compiled = 0

    def get(self, source: str) -> tuple[Any, Any]:
        entry = self._programs.get(source)
        if entry is None:
            program = self._ctx.program(vertex_shader=VERTEX_SHADER, fragment_shader=source)
            entry = (program, self._ctx.vertex_array(program, []))
            self._programs[source] = entry
            self.compiled += 1
        return entry

    def release_all(self) -> None:
        for program, vao in self._programs.values():
            vao.release()
            program.release()
        self._programs.clear()
