"""The conformance runner: ONNX's own backend node test cases through asyncinfer (or ONNX Runtime).

Every case that ships with the installed ``onnx`` (``onnx.backend.test.case.node``) is a small
model with inputs and expected outputs. A case passes when the model loads, runs, and every output
has the expected shape and dtype and matches within the case's own ``rtol``/``atol`` (NaN equal to
NaN), as ONNX's backend test runner checks. The same harness runs ONNX Runtime for comparison.
"""
from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

CASE_TIMEOUT_S = 60.0


@dataclass
class CaseResult:
    """Outcome of one node case: ``status`` is ``passed``, ``failed``, ``unsupported`` or ``error``."""

    name: str
    op: str
    status: str
    detail: str = ""
    wholly_on_backend: bool = True
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclass
class Report:
    engine: str
    results: list[CaseResult] = field(default_factory=list)

    @property
    def passed(self) -> int:
        return sum(r.passed for r in self.results)

    @property
    def failed(self) -> int:
        return len(self.results) - self.passed

    @property
    def passed_wholly_on_backend(self) -> int:
        return sum(r.passed and r.wholly_on_backend for r in self.results)

    def by_op(self) -> dict[str, tuple[int, int]]:
        passed, total = Counter(), Counter()
        for r in self.results:
            total[r.op] += 1
            passed[r.op] += r.passed
        return {op: (passed[op], total[op]) for op in sorted(total)}


def load_cases(pattern: str | None = None) -> list[Any]:
    """The node test cases of the installed onnx, optionally filtered by a regular expression."""
    from onnx.backend.test.case.node import collect_testcases

    cases = collect_testcases()
    if pattern:
        regex = re.compile(pattern)
        cases = [c for c in cases if regex.search(c.name)]
    return sorted(cases, key=lambda c: c.name)


def case_op(case: Any) -> str:
    """The op a case is about: its single node's op, else the op whose name the case name holds."""
    nodes = case.model.graph.node
    if len(nodes) == 1:
        return nodes[0].op_type
    simple = case.name.removeprefix("test_").replace("_", "").lower()
    candidates = sorted({n.op_type for n in nodes}, key=len, reverse=True)
    for op in candidates:
        if simple.startswith(op.lower()):
            return op
    return nodes[-1].op_type if nodes else "?"


def _as_array(value: Any) -> Any:
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, list):
        return [_as_array(v) for v in value]
    return value


def _comparable(a: np.ndarray) -> np.ndarray:
    """ml_dtypes types (bfloat16, float8, float4, int4…) compare through float32, where NumPy's
    tolerance arithmetic works; they are kind 'V', except some float8 variants that claim 'f'."""
    narrow = a.dtype.kind == "V" or a.dtype.name.startswith(("float8", "float4"))
    return a.astype(np.float32) if narrow else a


def compare_outputs(got: Sequence[Any], expected: Sequence[Any], rtol: float, atol: float) -> None:
    """Raise AssertionError unless every output matches (shape, dtype, values within tolerance)."""
    if len(got) != len(expected):
        raise AssertionError(f"{len(got)} outputs, expected {len(expected)}")
    for i, (g, e) in enumerate(zip(got, expected)):
        if isinstance(e, list):
            if not isinstance(g, list) or len(g) != len(e):
                raise AssertionError(f"output {i}: expected a sequence of {len(e)}")
            compare_outputs(g, e, rtol, atol)
            continue
        if e is None:
            if g is not None:
                raise AssertionError(f"output {i}: expected an empty optional")
            continue
        g, e = np.asarray(g), np.asarray(e)
        if g.shape != e.shape:
            raise AssertionError(f"output {i}: shape {g.shape}, expected {e.shape}")
        if e.dtype == object or e.dtype.kind in "SU":
            np.testing.assert_array_equal(g, e, err_msg=f"output {i}")
            continue
        if g.dtype != e.dtype:
            raise AssertionError(f"output {i}: dtype {g.dtype}, expected {e.dtype}")
        out_rtol = max(rtol, 2 ** -6) if e.dtype.name == "bfloat16" else rtol
        np.testing.assert_allclose(_comparable(g), _comparable(e), rtol=out_rtol, atol=atol, equal_nan=True,
                                   err_msg=f"output {i}")


# -- engines ---------------------------------------------------------------------------------------
Engine = Callable[[onnx.ModelProto, list], tuple[list, bool]]  # → (outputs, wholly on the backend)


def asyncinfer_engine(backend: str = "cpu") -> Engine:
    import asyncinfer as ai

    def run(model: onnx.ModelProto, inputs: list) -> tuple[list, bool]:
        loaded = ai.load_model(model)
        with ai.Worker(loaded, backend, threads=1) as worker:
            names = [i.name for i in loaded.inputs]
            feeds = dict(zip(names, inputs[: len(names)]))
            execution = worker.schedule(feeds)
            outputs = []
            for info in loaded.outputs:
                tensor = execution.take_output(info.name)
                if not tensor._readback_future().wait(CASE_TIMEOUT_S):  # computed and downloaded
                    raise TimeoutError(f"no result after {CASE_TIMEOUT_S} s")
                outputs.append(tensor.download_to_array())
            return outputs, not worker.placement.fallback

    return run


def onnxruntime_engine() -> Engine:
    import onnxruntime as ort

    def run(model: onnx.ModelProto, inputs: list) -> tuple[list, bool]:
        options = ort.SessionOptions()
        options.log_severity_level = 4
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        feeds = {n: v for n, v in zip(names, inputs)}
        return session.run(None, feeds), True

    return run


def run_case(case: Any, engine: Engine) -> CaseResult:
    """Run one case (every data set) and classify the outcome; never raises."""
    from .errors import UnsupportedOperatorError

    op = case_op(case)
    started = time.perf_counter()
    wholly = True
    try:
        for inputs, expected in case.data_sets:
            got, on_backend = engine(case.model, [_as_array(v) for v in inputs])
            wholly = wholly and on_backend
            compare_outputs([_as_array(g) for g in got], [_as_array(e) for e in expected], case.rtol, case.atol)
    except UnsupportedOperatorError as exc:
        return CaseResult(case.name, op, "unsupported", str(exc).splitlines()[-1].strip(" -"), False,
                          time.perf_counter() - started)
    except AssertionError as exc:
        return CaseResult(case.name, op, "failed", _first_line(exc), wholly, time.perf_counter() - started)
    except Exception as exc:  # noqa: BLE001 - any engine error counts as a failure of the case
        return CaseResult(case.name, op, "error", f"{type(exc).__name__}: {_first_line(exc)}", wholly,
                          time.perf_counter() - started)
    return CaseResult(case.name, op, "passed", "", wholly, time.perf_counter() - started)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines() or [""])[0][:200]


def run_cases(cases: Iterable[Any], engine: Engine, name: str,
              progress: Callable[[CaseResult], None] | None = None) -> Report:
    report = Report(name)
    import warnings

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        for case in cases:
            result = run_case(case, engine)
            report.results.append(result)
            if progress:
                progress(result)
    return report


def format_report(report: Report, backend: str, per_op: bool = True, failures: bool = False) -> str:
    lines = []
    if per_op:
        lines.append(f"{'op':<36} passed/total  ({report.engine})")
        for op, (passed, total) in report.by_op().items():
            lines.append(f"{op:<36} {passed:>6}/{total:<6}")
    if failures:
        for r in report.results:
            if not r.passed:
                lines.append(f"{r.status:<11} {r.name}: {r.detail}")
    lines.append(f"{report.engine}: {report.passed} of {len(report.results)} cases passed, "
                 f"{report.passed_wholly_on_backend} of them wholly on {backend}")
    return "\n".join(lines)
