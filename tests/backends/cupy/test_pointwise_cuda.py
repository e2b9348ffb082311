"""The CUDA C that gpu_compute generates from the element-wise tables, proven without a GPU.

There is no CUDA device in CI, but there is a C++ compiler: the CUDA prelude
(``fusion.CUDA_PRELUDE``) and the generated code are plain C on ``float`` once ``__device__``
and ``__forceinline__`` are empty macros and ``__int_as_float`` is a bit copy. Every device
expression of the table (each activation also with non-default attributes), Clip with various
bounds, a few chains and every binary expression (over every pair of samples) are compiled, the
activations as the very ``ElementwiseKernel`` operation text
(:func:`~asyncinfer.backends.cupy.fusion.epilogue_source`), into one shared library loaded with
ctypes, run on float32 samples (NaN and ±inf included) and compared with the CPU ops, i.e. the
table's NumPy functions (rtol 1e-5, atol 1e-6; NaN where NaN). A last test runs
:class:`FusedEpilogue` itself with a stand-in for CuPy whose ``ElementwiseKernel`` compiles the
same way. Skipped, saying so, where no C++ compiler is found.
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import numpy as np
import pytest

from asyncinfer import ops
from asyncinfer.backends.cupy.fusion import (CUDA_PRELUDE, FusedEpilogue, chain_code, cuda_float, epilogue_source)
from asyncinfer.model.ir import Layer
from asyncinfer.ops.pointwise import (ACTIVATIONS, BINARY_OPS, DIALECT, UNARY_OPS, fold_expression, rename, substitute,
                                      to_cuda)

CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
needs_cxx = pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++, c++ or clang++) on PATH to build the "
                                                   "generated CUDA C as host code")
TOL = dict(rtol=1e-5, atol=1e-6)

# The CUDA device environment the prelude relies on, as host C++.
SHIM = r"""
#include <cmath>
#include <math.h>
#include <cstring>
#define __device__
#define __forceinline__
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, sizeof f); return f; }
"""

ATTRIBUTES = {"HardSigmoid": dict(alpha=0.3, beta=0.4), "LeakyRelu": dict(alpha=0.2), "Elu": dict(alpha=0.5),
              "Selu": dict(alpha=1.5, gamma=2.0), "Celu": dict(alpha=2.0), "ThresholdedRelu": dict(alpha=0.5),
              "Shrink": dict(lambd=1.0, bias=0.3), "Gelu": dict(approximate="tanh"), "Swish": dict(alpha=-0.5)}
SPECIALS = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 0.5, -0.5, 1.5, -2.5, 1.0, -1.0, 1e-4, -1e-4, 0.99, 6.0,
                     -6.0, 30.0, -30.0, 100.0, -100.0], np.float32)


def op(name: str, attrs: dict | None = None, n_inputs: int = 1, version: int | None = None) -> ops.Op:
    version = max({**UNARY_OPS, **BINARY_OPS}[name].versions) if version is None else version
    return ops.create(Layer(name="n", op_type=name, inputs=[f"i{k}" for k in range(n_inputs)], outputs=["o"],
                            attrs=dict(attrs or {}), version=version))


def clip(*bounds) -> tuple:
    return op("Clip", n_inputs=3, version=13), [None if b is None else np.array(b, np.float32) for b in bounds]


def _single(name: str, attrs: dict) -> str:
    """``v = expression;`` of any device entry (activations through chain_code, as fused)."""
    layer_op = op(name, attrs)
    if name in ACTIVATIONS:
        return chain_code([(layer_op, [])])
    return f"v = {rename(UNARY_OPS[name].device_expression(layer_op, cuda_float, to_cuda), 'x', 'v')};"


# (id, C body, the activation chain to compute on the CPU)
CASES: list[tuple[str, str, list]] = []
for _name, _entry in sorted(UNARY_OPS.items()):
    if _entry.on_device:
        for _attrs in [{}] + ([ATTRIBUTES[_name]] if _name in ATTRIBUTES else []):
            _id = _name + "".join(f"-{k}={v}" for k, v in _attrs.items())
            CASES.append((_id, _single(_name, _attrs), [(op(_name, _attrs), [])]))
for _bounds in [(0.0, 6.0), (-np.inf, 1.0), (None, 0.2), (0.1,), (0.9, 0.1), (np.nan, 1.0), (-1.0, np.inf)]:
    _op, _extras = clip(*_bounds)
    CASES.append((f"Clip{_bounds}", chain_code([(_op, _extras)]), [(_op, _extras)]))
for _chain in ([(op("LeakyRelu", dict(alpha=0.2)), []), (op("Sigmoid"), [])], [(op("Relu"), []), clip(0.1, 0.6)],
               [(op("Gelu"), []), (op("Swish"), []), (op("Shrink", dict(lambd=0.1)), [])]):
    CASES.append(("+".join(o.op_type for o, _ in _chain), chain_code(_chain), _chain))


def cpu(chain: list, x: np.ndarray) -> np.ndarray:
    """The chain on the CPU ops, as float32 (predicates as 0/1, Not on x != 0)."""
    y = x
    for layer_op, extras in chain:
        if UNARY_OPS.get(layer_op.op_type) is not None and UNARY_OPS[layer_op.op_type].bool_input:
            y = y != 0
        (y,) = layer_op(y, *extras)
        y = y.astype(np.float32)
    return y


def samples(rng, case_id: str) -> np.ndarray:
    if case_id == "Not":
        return (rng.random(64) > 0.5).astype(np.float32)
    return np.concatenate([SPECIALS, (rng.standard_normal(64) * 3).astype(np.float32)])


def compile_library(functions: dict[str, str], tmp_path_factory) -> ctypes.CDLL:
    """Compile ``{function name: ElementwiseKernel operation}`` with the prelude into one library:
    ``void name(const float* x, const float* b, float* y, long n)``."""
    parts = [SHIM, CUDA_PRELUDE]
    for fname, operation in functions.items():
        parts.append(f'extern "C" void {fname}(const float* xs, const float* bs, float* ys, long n) {{\n'
                     f"  for (long i = 0; i < n; ++i) {{ const float x = xs[i]; const float b = bs[i]; float y;\n"
                     f"    {operation}\n    ys[i] = y; }}\n}}\n")
    folder = tmp_path_factory.mktemp("cuda_as_cpp")
    source, library = folder / "epilogues.cpp", folder / "epilogues.so"
    source.write_text("\n".join(parts))
    result = subprocess.run([CXX, "-std=c++17", "-O2", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC",
                             "-Werror=implicit-function-declaration", str(source), "-o", str(library)],
                            capture_output=True, text=True)
    assert result.returncode == 0, f"the generated CUDA C does not compile:\n{result.stderr[-4000:]}"
    lib = ctypes.CDLL(str(library))
    for fname in functions:
        getattr(lib, fname).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    return lib


def call(lib: ctypes.CDLL, fname: str, x: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    b = np.zeros_like(x) if b is None else np.ascontiguousarray(np.broadcast_to(b, x.shape), np.float32)
    y = np.empty_like(x)
    getattr(lib, fname)(x.ctypes.data, b.ctypes.data, y.ctypes.data, x.size)
    return y


BINARY = sorted(name for name, entry in BINARY_OPS.items() if entry.on_device)


def binary_operation(name: str) -> str:
    """``y = expression(a = x, b = b);`` of a binary entry (variadic ones folded over two inputs)."""
    entry = BINARY_OPS[name]
    layer_op = op(name, n_inputs=2)
    expression = entry.device_expression(layer_op, cuda_float, to_cuda)
    if entry.variadic:
        expression = fold_expression(entry, expression, ["a", "b"])
    return f"y = {substitute(expression, {'a': 'x', 'b': 'b'})};"


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    if CXX is None:
        pytest.skip("no C++ compiler (g++, c++ or clang++) on PATH to build the generated CUDA C as host code")
    functions = {}
    for k, (_, body, _) in enumerate(CASES):
        functions[f"plain_{k}"] = epilogue_source(body, bias=False)[2]
        functions[f"bias_{k}"] = epilogue_source(body, bias=True)[2]
    for name in BINARY:
        functions[f"binary_{name}"] = binary_operation(name)
    return compile_library(functions, tmp_path_factory)


def test_the_prelude_defines_the_whole_dialect():
    defined = dict(re.findall(r"AI_F ai_(\w+)\(([^)]*)\)", CUDA_PRELUDE))
    assert set(defined) == set(DIALECT)
    for name, params in defined.items():
        assert len(params.split(",")) == DIALECT[name], name


def test_every_fusable_activation_fuses_on_cuda():
    for name in ACTIVATIONS:
        body = chain_code([(op(name), [])])
        assert body is not None and body.startswith("v = ") and "?" not in body, name


def test_generated_code_matches_the_hand_written_forms():
    relu = chain_code([(op("Relu"), [])])
    assert relu == "v = (ai_relu(v));"
    leaky = chain_code([(op("LeakyRelu", dict(alpha=0.2)), [])])
    assert leaky == "v = (ai_pick(ai_ge(v, 0.0f), v, 0.20000000298023224f * v));"
    assert chain_code([clip(0.0, 6.0)]) == "v = (ai_min(ai_max(v, 0.0f), 6.0f));"
    assert chain_code([clip(-np.inf, 1.0)]) == "v = (ai_min(v, 1.0f));", "an infinite lower bound changes nothing"
    assert chain_code([(op("Exp"), [])]) is None, "Exp is not an activation: never fused"


@needs_cxx
@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_generated_cuda_matches_the_cpu(library, index, rng):
    case_id, _, chain = CASES[index]
    x = samples(rng, case_id)
    with np.errstate(all="ignore"):
        want = cpu(chain, x)
    np.testing.assert_allclose(call(library, f"plain_{index}", x), want, equal_nan=True, **TOL)
    if case_id != "Not":  # with a bias: activations(x + b)
        b = (rng.standard_normal(x.shape) * 0.5).astype(np.float32)
        with np.errstate(all="ignore"):
            want = cpu(chain, x + b)
        np.testing.assert_allclose(call(library, f"bias_{index}", x, b), want, equal_nan=True, **TOL)


@needs_cxx
@pytest.mark.parametrize("name", BINARY)
def test_generated_cuda_of_binary_expressions_matches_the_cpu(library, name, rng):
    entry = BINARY_OPS[name]
    if entry.logical:
        a, b = (rng.random((2, 64)) > 0.5).astype(np.float32)
    else:
        values = np.concatenate([SPECIALS, (rng.standard_normal(24) * 3).astype(np.float32), np.float32([2, 3, -3])])
        a, b = (m.ravel() for m in np.meshgrid(values, values))  # every pair, specials included
    layer_op = op(name, n_inputs=2)
    with np.errstate(all="ignore"):
        (want,) = layer_op(*(x != 0 for x in (a, b))) if entry.logical else layer_op(a, b)
    np.testing.assert_allclose(call(library, f"binary_{name}", a, b), want.astype(np.float32), equal_nan=True, **TOL)


class _HostElementwiseKernel:
    """``cupy.ElementwiseKernel`` on the host: the preamble and operation compiled with the C++
    compiler, run on NumPy arrays (``b`` broadcast to ``x``), written to ``out`` or a new array."""

    def __init__(self, factory, in_params, out_params, operation, name, preamble=""):
        assert out_params == "T y" and in_params in ("T x", "T x, T b") and preamble == CUDA_PRELUDE
        self.factory, self.bias, self.operation, self.name = factory, in_params == "T x, T b", operation, name

    def __call__(self, x, *rest):
        b, rest = (rest[0], rest[1:]) if self.bias else (None, rest)
        out = rest[0] if rest else None
        lib = compile_library({self.name: self.operation}, self.factory)
        y = call(lib, self.name, x, b)
        if out is None:
            return y
        out[...] = y
        return out


class _HostCuPy:
    def __init__(self, factory):
        self.factory = factory
        self.built = 0

    def ElementwiseKernel(self, *args, **kwargs):  # noqa: N802 - CuPy's name
        self.built += 1
        return _HostElementwiseKernel(self.factory, *args, **kwargs)


@needs_cxx
def test_fused_epilogue_runs_the_generated_kernel(tmp_path_factory, rng):
    host_cupy = _HostCuPy(tmp_path_factory)
    fuse = FusedEpilogue(host_cupy)
    x = np.concatenate([SPECIALS, rng.standard_normal(28).astype(np.float32) * 3]).reshape(3, 4, 4)
    b = rng.standard_normal((3, 1, 1)).astype(np.float32)
    chain = [(op("Gelu", dict(approximate="tanh")), []), clip(-0.25, 0.5)]
    with np.errstate(all="ignore"):
        want = cpu(chain, x + b)
    np.testing.assert_allclose(fuse(x, b, chain), want, equal_nan=True, **TOL)
    inplace = x.copy()
    assert fuse(inplace, b, chain, inplace) is inplace, "Conv and Gemm fuse into their own output"
    np.testing.assert_allclose(inplace, want, equal_nan=True, **TOL)
    assert host_cupy.built == 1, "one kernel per distinct chain, reused"
    elu = [(op("Elu", dict(alpha=0.5)), [])]
    with np.errstate(all="ignore"):
        np.testing.assert_allclose(fuse(x, None, elu), cpu(elu, x), equal_nan=True, **TOL)
    assert fuse(x.astype(np.float16), None, elu) is None, "only float32 chains are fused"
