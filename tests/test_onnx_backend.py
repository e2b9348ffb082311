"""ONNX's official backend test through asyncinfer's ``onnx.backend`` adapter (asyncinfer.onnx_backend).

``onnx.backend.test.BackendTest`` runs every case the installed onnx ships without a download: the
node cases, the simple models, the pytorch-converted and pytorch-operator models, and the "real"
models whose weights ship in onnx/backend/test/data/light (ResNet-50, VGG-19… with small random
weights). The node cases are the ones tests/test_conformance.py runs through the engine directly;
here they go through the official runner and the adapter, as any tool using ``onnx.backend`` would.

The cases listed in tests/backend_test_expected_failures.txt (pattern, then why) are excluded, and
`test_expected_failures_still_fail` checks that each one still fails: the list can only shrink.
Only the CPU copies run (the adapter's one device); the runner's CUDA copies are dropped rather than
reported as 2,000 skips.
"""
from __future__ import annotations

import io
import re
import unittest
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnx.backend.test
import pytest
from onnx import helper

import asyncinfer as ai
import asyncinfer.onnx_backend as backend
from model_zoo import LARGE_LIGHT_MODELS

EXPECTED_FAILURES_FILE = Path(__file__).with_name("backend_test_expected_failures.txt")
RANDOM = "(random)"

# The kernels of some cases divide by zero or take log(0) on purpose, on the worker's threads.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def read_expected_failures(path: Path = EXPECTED_FAILURES_FILE) -> list[tuple[str, str]]:
    """``(pattern, reason)`` of every entry: a regular expression, whitespace, then why."""
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        pattern, _, reason = line.partition(" ")
        if not reason.strip():
            raise ValueError(f"{path.name}:{number}: {pattern!r} gives no reason")
        re.compile(pattern)
        entries.append((pattern, reason.strip()))
    return entries


EXPECTED_FAILURES = read_expected_failures()


def _cpu_only(test_cases: dict[str, type]) -> dict[str, type]:
    for case in test_cases.values():
        for name in [n for n in vars(case) if n.startswith("test_") and n.endswith("_cuda")]:
            delattr(case, name)
    return test_cases


def _runner() -> onnx.backend.test.BackendTest:
    return onnx.backend.test.BackendTest(backend, __name__)


_official = _runner()
for _pattern, _ in EXPECTED_FAILURES:
    _official.exclude(_pattern)
globals().update(_cpu_only(_official.test_cases))  # OnnxBackendNodeModelTest, …SimpleModelTest, …RealModelTest…
# The large real models' cases hold 1-2 GB each: they run first, while the process is small
# (``memory_heavy``, tests/conftest.py; run late on a cold kernel cache, VGG-19's peaked at 3.75 GB).
_real_models = _official.test_cases["OnnxBackendRealModelTest"]
for _name in LARGE_LIGHT_MODELS:
    if hasattr(_real_models, f"test_{_name}_cpu"):
        setattr(_real_models, f"test_{_name}_cpu", pytest.mark.memory_heavy(getattr(_real_models, f"test_{_name}_cpu")))
del _real_models  # (a class bound to a module name is collected again under it)


@pytest.fixture(autouse=True, scope="module")
def _onnx_home(tmp_path_factory):
    """The runner writes the "real" models' inputs under $ONNX_HOME: a temporary folder, not ~/.onnx."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ONNX_HOME", str(tmp_path_factory.mktemp("onnx_home")))
        patch.delenv("ONNX_MODELS", raising=False)
        yield


def _cpu_case_names() -> dict[str, str]:
    """Every CPU test of the runner, by name: its category (Node, Simple, Real…)."""
    return {name: category.removeprefix("OnnxBackend").removesuffix("ModelTest")
            for category, case in _cpu_only(_runner().test_cases).items()
            for name in vars(case) if name.startswith("test_")}


def _matching(pattern: str, names) -> list[str]:
    return sorted(n for n in names if re.search(pattern, n))


# -- the list ------------------------------------------------------------------------------------------
def test_every_expected_failure_names_shipped_cases_and_says_why():
    names = _cpu_case_names()
    excluded: set[str] = set()
    for pattern, reason in EXPECTED_FAILURES:
        matched = _matching(pattern, names)
        assert matched, f"{pattern!r} matches no case of this onnx: remove it from {EXPECTED_FAILURES_FILE.name}"
        assert len(reason) > 20, f"{pattern!r}: say why it cannot pass"
        excluded.update(matched)
    by_category: dict[str, list[int]] = {}
    for name, category in names.items():
        by_category.setdefault(category, [0, 0])[name in excluded] += 1
    summary = ", ".join(f"{c} {p}/{p + f}" for c, (p, f) in sorted(by_category.items()))
    print(f"\nBackendTest through asyncinfer.onnx_backend: {len(names) - len(excluded)} of {len(names)} cases "
          f"run and must pass, {len(excluded)} expected failures ({summary})")
    assert len(excluded) <= 7  # the list only shrinks


def test_expected_failures_still_fail():
    """Each listed case fails through the official runner (but those that fail only by chance)."""
    checked = [p for p, reason in EXPECTED_FAILURES if not reason.startswith(RANDOM)]
    runner = _runner()
    for pattern in checked:
        runner.include(pattern)
    suite = unittest.TestSuite()
    for case in _cpu_only(runner.test_cases).values():
        names = sorted({n for p in checked for n in _matching(p, vars(case))})
        suite.addTests(case(n) for n in names)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        result = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(suite)
    failed = {test.id().rsplit(".", 1)[-1] for test, _ in result.failures + result.errors}
    ran = {n for p in checked for n in _matching(p, _cpu_case_names())}
    assert result.testsRun == len(ran) > 0
    passing = sorted(ran - failed)
    assert not passing, f"these cases pass now: remove them from {EXPECTED_FAILURES_FILE.name}: {passing}"


# -- the adapter ---------------------------------------------------------------------------------------
def _add_model() -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["sum"]), helper.make_node("Neg", ["sum"], ["neg"])],
                              "g", [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, ["n"]),
                                    helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info("sum", onnx.TensorProto.FLOAT, ["n"]),
                               helper.make_tensor_value_info("neg", onnx.TensorProto.FLOAT, ["n"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_prepare_and_run_return_outputs_in_order_and_by_name():
    a, b = np.float32([1, 2]), np.float32([10, 20])
    with backend.prepare(_add_model(), "CPU") as rep:
        out = rep.run([a, b])
        np.testing.assert_array_equal(out[0], a + b)
        np.testing.assert_array_equal(out["neg"], -(a + b))
        np.testing.assert_array_equal(rep.run({"b": b, "a": a}).sum, a + b)  # a mapping by name
        with pytest.raises(ai.InputError, match="'b' must be float32"):  # the engine's own checks
            rep.run([a, b.astype(np.float64)])
    with pytest.raises(ai.DisposedError):
        rep.run([a, b])


def test_run_model_and_run_node():
    a, b = np.float32([1, 2]), np.float32([10, 20])
    np.testing.assert_array_equal(backend.run_model(_add_model(), [a, b])[1], -(a + b))
    node = helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)
    x, w = np.ones((2, 3), np.float32), np.arange(12, dtype=np.float32).reshape(4, 3)
    (y,) = backend.run_node(node, [x, w])
    np.testing.assert_allclose(y, x @ w.T)
    (y,) = backend.run_node(node, [x, w], outputs_info=[(np.float32, (2, 4))], opset_version=13)
    np.testing.assert_allclose(y, x @ w.T)
    with pytest.raises(ValueError, match="takes 2 inputs"):
        backend.run_node(node, [x])


def test_devices():
    assert backend.supports_device("CPU") and backend.supports_device("CPU:0")
    assert not backend.supports_device("CUDA") and not backend.supports_device("TPU")
    with pytest.raises(ValueError, match="runs on 'CPU'"):
        backend.prepare(_add_model(), "CUDA")


def test_load_errors_are_asyncinfer_errors():
    model = _add_model()
    model.graph.node[1].op_type = "NoSuchOp"
    with pytest.raises(ai.UnsupportedOperatorError, match="NoSuchOp"):
        backend.prepare(model)
    with pytest.raises(TypeError, match="unknown options"):
        backend.prepare(_add_model(), colour="red")
