"""Shared fixtures: small model builders and test-only ops (gates, barriers, failures).

The test-only ops live in the ``test.asyncinfer`` domain. They let tests control *when* a layer
finishes, so properties like "schedule returns before the work is done" or "independent layers
run in parallel" are asserted by construction, never by timing.

The tests mirror the source tree: tests/ops/, tests/model/, tests/loader/, tests/backends/<name>/,
tests/runtime/, tests/serving/; the entry points (cli, conformance, docs, examples, bench, the
default and zoo models) are tested here at the top. Every folder below is a package (test files in
two folders may share a name). Helpers shared by several folders live here and are imported by
bare name from anywhere (pyproject's ``pythonpath``): this file's builders, ``node_cases`` (the one
node-case harness, every backend), ``pixel_testing``, ``model_zoo``; and tests/ops/op_testing.py.
"""
from __future__ import annotations

import os
import random
import socket
import sys
import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import asyncinfer as ai
from asyncinfer.backends.cpu.memory import release_free_memory
from asyncinfer.ops.base import Op
from asyncinfer.ops.registry import register

TEST_DOMAIN = "test.asyncinfer"
GATES: dict[str, threading.Event] = {}
BARRIERS: dict[str, threading.Barrier] = {}


@register("Gate", versions=(1,), domain=TEST_DOMAIN)
class Gate(Op):
    """Identity that waits until the event named by attribute ``gate`` is set (bounded: 30 s)."""

    def run(self, x):
        if not GATES[self.attr("gate")].wait(30):
            raise TimeoutError("gate never opened")
        return x.copy()


@register("Rendezvous", versions=(1,), domain=TEST_DOMAIN)
class Rendezvous(Op):
    """Identity that waits for ``parties`` layers to meet: passes only if they run in parallel."""

    def run(self, x):
        BARRIERS[self.attr("barrier")].wait(30)
        return x.copy()


@register("Fail", versions=(1,), domain=TEST_DOMAIN)
class Fail(Op):
    """Raises, like a kernel hitting bad data."""

    def run(self, x):
        raise ValueError("deliberate failure for the test")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, outside the OS's ephemeral range (so a process started
    meanwhile, a Ray worker say, cannot be handed it by ``bind(0)`` before the server binds it)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(15000, 32000)  # below Linux's 32768-60999 and macOS's 49152-65535
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port found between 15000 and 32000")


def make_model(nodes, inputs, outputs, initializers=(), opset=17, extra_domains=(TEST_DOMAIN,)) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "test_graph", inputs, outputs, initializer=list(initializers))
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in extra_domains]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="asyncinfer-tests")
    model.ir_version = 8
    return model


def tensor_info(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def shape_arithmetic_model() -> onnx.ModelProto:
    """``y = Reshape(r, Concat(Shape(r)[0:1], [-1]))`` with ``r = Relu(x)``, x of shape (N, 2, 3):
    the Shape/Slice/Concat layers compute a shape (CPU-bound), Relu and Reshape compute values."""
    from onnx import numpy_helper

    minus_one = numpy_helper.from_array(np.array([-1], np.int64), "minus_one")
    starts = numpy_helper.from_array(np.array([0], np.int64), "starts")
    ends = numpy_helper.from_array(np.array([1], np.int64), "ends")
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Shape", ["r"], ["s"], name="shape"),
             helper.make_node("Slice", ["s", "starts", "ends"], ["s0"], name="slice"),
             helper.make_node("Concat", ["s0", "minus_one"], ["target"], axis=0, name="concat"),
             helper.make_node("Reshape", ["r", "target"], ["y"], name="reshape")]
    return make_model(nodes, [tensor_info("x", ["N", 2, 3])], [tensor_info("y", ["N", 6])],
                      [minus_one, starts, ends], extra_domains=())


@pytest.fixture
def gate():
    """A fresh named gate; opened at teardown so no pool thread stays stuck."""
    name = f"gate{len(GATES)}"
    GATES[name] = threading.Event()
    yield name, GATES[name]
    GATES[name].set()


@pytest.fixture
def add_chain_model():
    """y = ((x + 1) + 1) … n times, with symbolic batch dim."""

    def build(n: int = 5) -> onnx.ModelProto:
        one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
        nodes, prev = [], "x"
        for i in range(n):
            out = "y" if i == n - 1 else f"t{i}"
            nodes.append(helper.make_node("Add", [prev, "one"], [out], name=f"add{i}"))
            prev = out
        return make_model(nodes, [tensor_info("x", ["N", 4])], [tensor_info("y", ["N", 4])], [one])

    return build


@pytest.fixture
def gated_model(gate):
    """y = Gate(x) + 1: the run cannot finish before the test opens the gate."""
    name, event = gate
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    nodes = [helper.make_node("Gate", ["x"], ["g"], domain=TEST_DOMAIN, gate=name, name="gate"),
             helper.make_node("Add", ["g", "one"], ["y"], name="add")]
    proto = make_model(nodes, [tensor_info("x", [2, 3])], [tensor_info("y", [2, 3])], [one])
    return ai.load_model(proto), event


@pytest.fixture
def failing_model():
    """a = x + 1 → Fail → b; c = b * 2 (depends on the failure); d = x * 3 (independent)."""
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    two = helper.make_tensor("two", TensorProto.FLOAT, [1], [2.0])
    three = helper.make_tensor("three", TensorProto.FLOAT, [1], [3.0])
    nodes = [helper.make_node("Add", ["x", "one"], ["a"], name="add"),
             helper.make_node("Fail", ["a"], ["b"], domain=TEST_DOMAIN, name="broken_layer"),
             helper.make_node("Mul", ["b", "two"], ["c"], name="after_failure"),
             helper.make_node("Mul", ["x", "three"], ["d"], name="independent")]
    proto = make_model(nodes, [tensor_info("x", [2])], [tensor_info("c", [2]), tensor_info("d", [2])],
                       [one, two, three])
    return ai.load_model(proto)


@pytest.fixture(scope="session")
def digits_model():
    from asyncinfer import assets

    return ai.load_model(assets.default_model_path())


@pytest.fixture(scope="session")
def digits_samples():
    from asyncinfer import assets

    return assets.default_samples()


class LoopTicker:
    """Counts turns of the event loop: proof, without timing, that the loop kept running."""

    def __init__(self) -> None:
        self.ticks = 0

    async def run(self) -> None:
        import anyio

        while True:
            self.ticks += 1
            await anyio.sleep(0)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    """Tests marked ``@pytest.mark.anyio`` run under asyncio and under trio."""
    return request.param


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


#: Above this resident size a test's teardown hands the heap's free memory back to the OS.
_TRIM_ABOVE_BYTES = 768 * 2 ** 20


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Keep the suite within its memory budget: the CPU backend's allocator tuning
    (`backends.cpu.memory`) keeps freed blocks in glibc's heaps for the next run, and a worker
    the test did not close never hands them back (`release_free_memory`, a no-op off glibc), so
    each zoo test left the process 0.3-0.7 GiB larger (VGG-19's: 1.2 GiB resident after it, 0.4
    after a trim) and the suite's peak grew with the order of its tests (3.4-3.95 GiB)."""
    if _resident_bytes() > _TRIM_ABOVE_BYTES:
        release_free_memory()


def pytest_collection_modifyitems(config, items):
    """Run the tests marked ``memory_heavy`` (the large light models': `model_zoo.light_params`)
    first, while the process is small. The process grows through the suite and never shrinks
    back: numba keeps every kernel it compiled (on a cold kernel cache, CI's, the suite ends
    near 2.8 GiB, 0.7-1 GiB more than when the kernels load from the cache), and VGG-19's pixel
    test alone holds 2 GiB: run late on a cold cache, the suite peaked at 3.8-3.9 GiB."""
    heavy = [item for item in items if item.get_closest_marker("memory_heavy")]
    if heavy:
        items[:] = heavy + [item for item in items if not item.get_closest_marker("memory_heavy")]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Report the suite's peak memory (this process, and the largest subprocess it waited for):
    the README promises the tests fit in ~4 GiB, and CI's log keeps the figure."""
    try:
        import resource
    except ImportError:  # not on Windows
        return
    # ru_maxrss is in KiB on Linux, in bytes on macOS
    scale = 1 if sys.platform == "darwin" else 1024
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2 ** 30
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale / 2 ** 30
    terminalreporter.write_line(f"peak resident memory: {own:.2f} GiB (largest subprocess {child:.2f} GiB)")
