"""Shared helpers for the benchmarks: models, inputs, ONNX Runtime sessions, timing, reporting.

Every benchmark measures asyncinfer and ONNX Runtime in the same process, interleaved, and
reports medians (with p10/p90) and ratios: absolute times on a shared, noisy machine say little,
ratios taken under the same noise say more.
"""
from __future__ import annotations

import datetime as _dt
import asyncio
import gc
import inspect
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

# The light model-zoo models the latency benchmark runs by default (the ones small enough to
# time many times on a 2-core machine; alexnet/vgg19/zfnet512 are mostly one huge Gemm).
LIGHT_MODELS: tuple[str, ...] = ("resnet50", "densenet121", "inception_v2", "squeezenet", "shufflenet")


# -- models and inputs ------------------------------------------------------------------------------
def light_model_dir() -> Path:
    """The folder of the light model zoo shipped inside the ``onnx`` package."""
    return Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"


def light_model_path(name: str) -> Path:
    """Path of ``light_<name>.onnx``; raises FileNotFoundError listing the available names."""
    path = light_model_dir() / f"light_{name}.onnx"
    if not path.is_file():
        available = sorted(p.stem.removeprefix("light_") for p in light_model_dir().glob("light_*.onnx"))
        raise FileNotFoundError(f"no light model {name!r} in {light_model_dir()}; available: {available}")
    return path


def load_light_model(name: str) -> onnx.ModelProto:
    return onnx.load(str(light_model_path(name)))


def graph_inputs(proto: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The real inputs: graph inputs that are not initializers (old models list weights too)."""
    weights = {init.name for init in proto.graph.initializer}
    return [vi for vi in proto.graph.input if vi.name not in weights]


def standard_input(shape: Sequence[int], dtype: Any = np.float32) -> np.ndarray:
    """``arange(n).reshape(shape) / n``: the input convention of the ONNX backend model tests."""
    n = int(np.prod(shape, dtype=np.int64))
    return (np.arange(n, dtype=np.float64).reshape(tuple(shape)) / max(n, 1)).astype(dtype)


def standard_inputs(proto: onnx.ModelProto, batch: int = 1) -> dict[str, np.ndarray]:
    """One standard input per graph input; symbolic or zero dims become ``batch`` (first) or 1."""
    inputs = {}
    for vi in graph_inputs(proto):
        ttype = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else (batch if i == 0 else 1)
                for i, d in enumerate(ttype.shape.dim)]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(ttype.elem_type)
        inputs[vi.name] = standard_input(dims, dtype)
    return inputs


# -- ONNX Runtime -----------------------------------------------------------------------------------
def default_threads() -> int:
    """asyncinfer's default CPU pool size (the core count); both engines get this many threads."""
    return max(1, os.cpu_count() or 1)


def ort_session(model: onnx.ModelProto | bytes | str | Path, threads: int | None = None) -> Any:
    """An ONNX Runtime CPU session with default options.

    ``threads=None`` keeps ORT's own default intra-op pool; an int sets it (the benchmarks pass
    asyncinfer's pool size so both engines get the same number of threads).
    """
    import onnxruntime as ort  # imported here so modules import without onnxruntime installed

    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
    options.log_severity_level = 3  # warnings about unused initializers etc. are noise here
    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    elif isinstance(model, Path):
        model = str(model)
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def ort_runner(session: Any, inputs: Mapping[str, np.ndarray]) -> Callable[[], list[np.ndarray]]:
    """A no-argument callable running ``session`` on ``inputs`` (binds everything up front)."""
    feed = dict(inputs)
    return lambda: session.run(None, feed)


def ort_outputs(session: Any, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, dict(inputs))))


# -- correctness ------------------------------------------------------------------------------------
class OutputMismatch(AssertionError):
    """asyncinfer and ORT disagree: timing a wrong answer would be meaningless."""


def check_outputs_match(actual: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray],
                        rtol: float = 1e-3, atol: float = 1e-5) -> float:
    """Raise OutputMismatch unless every expected output matches; return the max abs difference."""
    missing = sorted(set(expected) - set(actual))
    if missing:
        raise OutputMismatch(f"outputs missing from asyncinfer: {missing} (got {sorted(actual)})")
    worst = 0.0
    for name, want in expected.items():
        got = np.asarray(actual[name])
        if got.shape != want.shape:
            raise OutputMismatch(f"output {name!r}: shape {got.shape} != ORT {want.shape}")
        diff = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))) if want.size else 0.0
        if not np.allclose(got, want, rtol=rtol, atol=atol):
            raise OutputMismatch(f"output {name!r}: max abs diff {diff:.3g} (rtol={rtol}, atol={atol})")
        worst = max(worst, diff)
    return worst


# -- timing -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    """Summary of repeated measurements, in milliseconds."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    max_ms: float
    n: int

    @classmethod
    def from_seconds(cls, samples: Sequence[float]) -> "Timing":
        if not samples:
            raise ValueError("no samples")
        ms = np.asarray(samples, dtype=np.float64) * 1e3
        p10, p50, p90 = np.percentile(ms, [10, 50, 90])
        return cls(float(p50), float(p10), float(p90), float(ms.min()), float(ms.max()), len(ms))

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


Thunk = Callable[[], Any]  # a no-argument callable; may return an awaitable (then it is awaited)


async def _call(fn: Thunk) -> None:
    result = fn()
    if inspect.isawaitable(result):
        await result


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Inside: the heap collected, then frozen (`gc.freeze`), as a latency-minded application does
    once its models are loaded (and as `asyncinfer serve` does, see docs/serving.md): a full
    collection otherwise scans every object alive, 50-60 ms with the GIL held once a GPT-2 worker
    is loaded, and shows up as one engine's loop-lag maximum by chance. Both engines get it.
    Unfrozen on the way out, so that what the next model measured leaves behind is collected."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# Contestants run in blocks: each block starts after a pause and with one untimed call, so every
# engine is timed in its own steady state. (Call-by-call interleaving would time each engine right
# after the other: ONNX Runtime's pool threads keep spinning for a while after a run and steal the
# cores from whoever runs next, and a pause before every call would instead time ORT's cold wake-up.)
SETTLE_S = 0.05
BLOCK = 4


async def time_interleaved_async(fns: Mapping[str, Thunk], repeats: int, warmup: int = 2,
                                 settle_s: float = SETTLE_S, block: int = BLOCK) -> dict[str, Timing]:
    """Time several callables in alternating blocks until each has ``repeats`` samples.

    Alternating blocks put slow machine noise (other tenants, frequency changes) on every
    contestant alike; the order rotates each round. Callables returning awaitables are awaited,
    so async and blocking contestants can share one event loop.
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            await _call(fns[name])
    samples: dict[str, list[float]] = {name: [] for name in names}
    round_ = 0
    while any(len(v) < repeats for v in samples.values()):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            await asyncio.sleep(settle_s)
            await _call(fns[name])  # untimed: the engine's first call after the pause
            for _ in range(min(block - 1, repeats - len(samples[name]))):
                start = time.perf_counter()
                await _call(fns[name])
                samples[name].append(time.perf_counter() - start)
        round_ += 1
    return {name: Timing.from_seconds(s) for name, s in samples.items()}


def time_interleaved(fns: Mapping[str, Thunk], repeats: int, warmup: int = 2,
                     settle_s: float = SETTLE_S, block: int = BLOCK) -> dict[str, Timing]:
    """Synchronous entry to :func:`time_interleaved_async` (runs it on a fresh event loop)."""
    return asyncio.run(time_interleaved_async(fns, repeats, warmup, settle_s, block))


def percentiles_ms(samples_s: Iterable[float], qs: Sequence[float] = (50, 99)) -> dict[str, float]:
    """Percentiles (and max) of samples given in seconds, as ``{"p50_ms": ..., "max_ms": ...}``."""
    ms = np.asarray(list(samples_s), dtype=np.float64) * 1e3
    if ms.size == 0:
        raise ValueError("no samples")
    out = {f"p{q:g}_ms": float(np.percentile(ms, q)) for q in qs}
    out["max_ms"] = float(ms.max())
    return out


def geomean(values: Iterable[float]) -> float:
    """Geometric mean of positive values (the right mean for ratios); NaN when empty."""
    vals = [float(v) for v in values]
    if not vals:
        return math.nan
    if any(v <= 0 or not math.isfinite(v) for v in vals):
        raise ValueError(f"geomean needs positive finite values, got {vals}")
    return math.exp(statistics.fmean(math.log(v) for v in vals))


# -- reporting --------------------------------------------------------------------------------------
def fmt(value: Any, digits: int = 3) -> str:
    """Numbers to ``digits`` significant figures; everything else through str()."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.{digits}g}" if abs(value) < 10 ** digits else f"{value:.0f}"
    return str(value)


def print_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None,
                file: Any = None) -> None:
    """A plain aligned text table (first column left-aligned, numbers right-aligned)."""
    file = file or sys.stdout
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    if title:
        print(f"\n{title}", file=file)
    print(line(headers), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for row in cells:
        print(line(row), file=file)


def cpu_model() -> str:
    """The CPU's marketing name: /proc/cpuinfo's "model name" on Linux, else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass  # not Linux: fall through
    return platform.processor() or platform.machine() or "unknown"


def environment() -> dict[str, Any]:
    """What the numbers were measured on, stored next to them."""
    env: dict[str, Any] = {
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "numpy": np.__version__,
        "onnx": onnx.__version__,
    }
    try:
        import onnxruntime

        env["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        env["onnxruntime"] = None
    try:
        import asyncinfer

        env["asyncinfer"] = asyncinfer.__version__
    except ImportError:
        env["asyncinfer"] = None
    env["blas"] = blas_kernels()
    return env


def blas_kernels() -> str:
    """NumPy's BLAS and the kernel set it runs (OpenBLAS picks one by CPU unless
    ``OPENBLAS_CORETYPE`` forces one): asyncinfer's GEMMs run on it, ORT's on its own MLAS, so a
    forced older set (AVX2 ``Haswell`` kernels on an AVX-512 CPU) slows asyncinfer alone (on the
    2-core Zen 5 VM a 258 x 256 @ 256 x 4 product took 13.6 µs on Haswell kernels, 3.9 on
    SkylakeX, and ResNet-18 14.4 against 9.9 ms)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "unknown (no threadpoolctl)"
    libs = [lib for lib in threadpool_info() if lib.get("user_api") == "blas" and "numpy" in lib.get("filepath", "")]
    if not libs:
        return "unknown"
    lib = libs[0]
    text = f"{lib.get('internal_api')} {lib.get('version')}, {lib.get('architecture') or '?'} kernels"
    forced = os.environ.get("OPENBLAS_CORETYPE")
    if lib.get("internal_api") == "openblas" and forced:
        text += f" (forced by OPENBLAS_CORETYPE={forced})"
    return text


def _jsonable(value: Any) -> Any:
    if isinstance(value, Timing):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf
    return value


def measure_each(models: Sequence[str], label: str, measure: Callable[[str], dict[str, Any]],
                 verbose: bool = True) -> dict[str, Any]:
    """``measure(name)`` for every model; one that cannot load or disagrees with ORT is recorded as
    ``{"error": ...}`` and the others still run."""
    import asyncinfer as ai

    per_model: dict[str, Any] = {}
    for name in models:
        if verbose:
            print(f"{label}: {name} ...", flush=True)
        try:
            per_model[name] = measure(name)
        except (ai.AsyncInferError, OutputMismatch, FileNotFoundError) as exc:
            per_model[name] = {"error": error_text(exc)}
            if verbose:
                print(f"  skipped: {per_model[name]['error']}", flush=True)
    return per_model


def backend_unavailable_reason(backend: str) -> str | None:
    """Why an asyncinfer ``backend`` cannot start here (its BackendUnavailableError), or None.

    Probes through the public API, a Worker on a one-Relu model, so the benchmarks do not depend
    on where each backend keeps its own device checks.
    """
    import asyncinfer as ai
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = ai.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))
    try:
        with ai.Worker(model, backend):
            return None
    except ai.BackendUnavailableError as exc:
        return str(exc)


def dig(result: Any, *keys: str) -> float | None:
    """``result[k1][k2]...`` as a float, or None when a step is missing (a skipped measurement)."""
    for key in keys:
        if not isinstance(result, Mapping) or key not in result:
            return None
        result = result[key]
    return float(result) if isinstance(result, (int, float)) and not isinstance(result, bool) else None


def missing_modules(*names: str) -> str | None:
    """``"needs a, b (not installed)"`` for the named modules that cannot be found here, else None."""
    import importlib.util

    missing = [name for name in names if importlib.util.find_spec(name) is None]
    return f"needs {', '.join(missing)} (not installed)" if missing else None


def add_engine_args(parser: Any, results: str) -> None:
    """The options every benchmark script shares: thread count and whether to write results."""
    parser.add_argument("--threads", type=int, default=None, help="threads for both engines (default: cores)")
    parser.add_argument("--no-write", action="store_true", help=f"do not write bench/results/{results}")


def cannot_run(script: str, reason: str) -> int:
    """Say on stderr why a benchmark script cannot run on this machine; the exit status to return (2)."""
    print(f"bench/{Path(script).name} cannot run here: {reason}", file=sys.stderr)
    return 2


def report(name: str, result: Mapping[str, Any], printer: Callable[[Any], None], write: bool) -> int:
    """Print a benchmark's report and, unless told not to, write ``bench/results/<name>.json``."""
    printer(result)
    if write:
        print(f"\nwrote {write_results(name, result)}")
    return 0


def write_results(name: str, data: Mapping[str, Any], results_dir: Path | None = None,
                  env: Mapping[str, Any] | None = None) -> Path:
    """Write ``{"environment": env, "results": data}`` to ``bench/results/<name>.json``.

    ``env`` defaults to :func:`environment` now; pass one to keep several files on one timestamp.
    """
    folder = results_dir or RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    payload = {"benchmark": name, "environment": dict(env or environment()), "results": _jsonable(data)}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def error_text(exc: BaseException, limit: int = 300) -> str:
    """A one-line description of why a measurement was skipped."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
