"""The server treats every request as untrusted: size limits, deadlines, a queue bound, a drain.

Each behaviour is made deterministic by construction: slow inference is a ``Gate`` layer that
cannot finish before the test opens it (never a race with the clock); the only durations are
small deadlines that a gated run cannot meet and generous bounds against hangs. After every
refusal the server still answers a good request.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import string
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager

import anyio
import anyio.from_thread
import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import asyncinfer as ai
from asyncinfer.runtime.execution import Execution
from asyncinfer.serving import create_app
from asyncinfer.serving.cli import add_serve_command, run_serve
from asyncinfer.serving.protocol import json_depth
from conftest import TEST_DOMAIN, make_model, tensor_info

HANG = 20  # seconds: a bound against hangs, never a timing assertion
DIGITS = "/v2/models/digits/infer"


@pytest.fixture
def gated_batch_model(gate):
    """y = Gate(x) + 1 on [N, 3] (batchable): runs cannot finish before the test opens the gate."""
    name, opened = gate
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    nodes = [helper.make_node("Gate", ["x"], ["g"], domain=TEST_DOMAIN, gate=name),
             helper.make_node("Add", ["g", "one"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", ["N", 3])], [tensor_info("y", ["N", 3])], [one])
    return ai.load_model(proto), opened


@asynccontextmanager
async def serving(models: dict, **options) -> AsyncIterator[httpx.AsyncClient]:
    """A client of ``create_app(models, **options)`` inside the app's lifespan."""
    app = create_app(models, **options)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server") as client:
            client.app = app  # type: ignore[attr-defined]
            yield client


def digits_request(images: np.ndarray) -> dict:
    return {"inputs": [{"name": "image", "shape": list(images.shape), "datatype": "FP32",
                        "data": images.ravel().tolist()}]}


def x_request(rows: int = 2) -> dict:
    return {"inputs": [{"name": "x", "shape": [rows, 3], "datatype": "FP32", "data": [1.0] * (3 * rows)}]}


async def wait_until(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(HANG):
        while not condition():
            await anyio.sleep(0.002)


def assert_error(response: httpx.Response, status: int, fragment: str = "") -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert fragment in response.json()["error"], response.json()


async def assert_still_serving(client: httpx.AsyncClient, images: np.ndarray) -> None:
    response = await client.post(DIGITS, json=digits_request(images[:1]))
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["shape"] == [1, 10]


# -- body size: 413 ---------------------------------------------------------------------------------
SMALL_BODY = ai.Limits().replace(max_request_bytes=4096)  # a one-image JSON request is about 1.4 KB


@pytest.mark.anyio
async def test_a_body_over_the_limit_is_refused_by_content_length_before_it_is_read(digits_model, digits_samples):
    pulled = []

    async def body() -> AsyncIterator[bytes]:
        pulled.append(1)
        yield b"x" * 5000

    async with serving({"digits": digits_model}, limits=SMALL_BODY) as client:
        response = await client.post(DIGITS, content=b"{" + b" " * 5000 + b"}")
        assert_error(response, 413, "the request body (bytes): 5002 exceeds Limits.max_request_bytes = 4096")
        response = await client.post(DIGITS, content=body(), headers={"Content-Length": "5000"})
        assert_error(response, 413, "max_request_bytes")
        assert pulled == []  # refused on the header alone
        assert_error(await client.post(DIGITS, content=b"{}", headers={"Content-Length": "two"}), 400,
                     "Content-Length must be an integer")
        await assert_still_serving(client, digits_samples[0])


@pytest.mark.anyio
async def test_a_chunked_body_over_the_limit_is_refused_while_streaming(digits_model, digits_samples):
    pulled = []

    async def body() -> AsyncIterator[bytes]:
        for _ in range(100):  # 100 KB in all, without Content-Length
            pulled.append(1)
            yield b" " * 1000

    async with serving({"digits": digits_model}, limits=SMALL_BODY) as client:
        response = await client.post(DIGITS, content=body())
        assert "content-length" not in response.request.headers
        assert_error(response, 413, "exceeds Limits.max_request_bytes = 4096")
        assert len(pulled) == 5  # stopped at the chunk that crossed the limit, not read whole
        # a chunked body under the limit is fine
        payload = json.dumps(digits_request(digits_samples[0][:1])).encode()

        async def small() -> AsyncIterator[bytes]:
            for i in range(0, len(payload), 100):
                yield payload[i:i + 100]

        assert (await client.post(DIGITS, content=small())).status_code == 200


# -- malformed and oversized requests: 400 --------------------------------------------------------------
STRICT = ai.Limits().replace(max_json_depth=12, max_tensor_rank=6, max_tensor_elements=10_000)


def image(shape, data=None) -> bytes:
    count = math.prod(d for d in shape if isinstance(d, int) and d >= 0) if isinstance(shape, list) else 0
    return json.dumps({"inputs": [{"name": "image", "shape": shape, "datatype": "FP32",
                                   "data": [0.5] * min(count, 64) if data is None else data}]}).encode()


def nested(depth: int) -> list:
    value: list = [0.5] * 64
    for _ in range(depth):
        value = [value]
    return value


BAD_BODIES = [
    ("deep data", image([1, 1, 8, 8], nested(20)), "nests 24 levels deep, more than Limits.max_json_depth = 12"),
    ("bracket bomb", b"[" * 200_000, "nests 200000 levels deep"),
    ("object bomb", b'{"a":' * 100_000, "nests 100000 levels deep"),
    ("rank", image([1] * 7 + [64]), "input 'image': 8 exceeds Limits.max_tensor_rank = 6"),
    ("elements", image([1000, 1, 8, 8]), "input 'image': 64000 exceeds Limits.max_tensor_elements = 10000"),
    ("absurd dim", image([10 ** 18, 1, 8, 8]), "exceeds Limits.max_tensor_elements"),
    ("float dim", image([1e18, 1, 8, 8]), "'shape' must be a list of non-negative integers, got [1e+18, 1, 8, 8]"),
    ("negative dim", image([-1, 1, 8, 8]), "'shape' must be a list of non-negative integers"),
    ("string dim", image(["1", 1, 8, 8]), "'shape' must be a list of non-negative integers"),
    ("bool dim", image([True, 1, 8, 8]), "'shape' must be a list of non-negative integers"),
    ("shape not a list", image("1x1x8x8"), "'shape' must be a list of non-negative integers, got '1x1x8x8'"),
    ("huge shape list", image([1] * 100_000), "input 'image': 100000 exceeds Limits.max_tensor_rank = 6"),
    ("too little data", image([2, 1, 8, 8]), "shape [2, 1, 8, 8] needs 128 elements, 'data' has 64"),
    ("too much data", image([1, 1, 8, 8], [0.5] * 65), "needs 64 elements, 'data' has 65"),
    ("huge numbers", image([1, 1, 8, 8], [10 ** 30] * 64), "FP32 data must be numbers, got mixed or non-numeric"),
    ("mixed sign big ints", image([1, 1, 8, 2], [-1, 2 ** 64] * 8), "got mixed or non-numeric values"),
    ("dicts as data", image([1, 1, 8, 8], [{}] * 64), "got mixed or non-numeric values"),
    ("null data", json.dumps({"inputs": [{"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32",
                                          "data": None}]}).encode(),
     "'data' must be a list (flat or nested), got null"),
    ("scalar data", json.dumps({"inputs": [{"name": "image", "shape": [1, 1, 1, 1], "datatype": "FP32",
                                            "data": 0.5}]}).encode(),
     "'data' must be a list (flat or nested), got a number"),
    ("long datatype", json.dumps({"inputs": [{"name": "image", "shape": [1], "datatype": "F" * 10_000,
                                              "data": [1]}]}).encode(), "unknown datatype 'FFFF"),
]


@pytest.mark.anyio
async def test_malformed_and_oversized_tensors_are_400(digits_model, digits_samples):
    async with serving({"digits": digits_model}, limits=STRICT) as client:
        for label, body, fragment in BAD_BODIES:
            response = await client.post(DIGITS, content=body)
            assert response.status_code == 400, (label, response.text[:300])
            error = response.json()["error"]
            assert fragment in error and len(error) < 1000, (label, error[:300])
        await assert_still_serving(client, digits_samples[0])


@pytest.mark.anyio
async def test_json_nested_beyond_the_parser_is_400_not_a_recursion_error(digits_model, digits_samples):
    lax = ai.Limits().replace(max_json_depth=10 ** 9)  # the depth check passes: json.loads recurses and gives up
    async with serving({"digits": digits_model}, limits=lax) as client:
        assert_error(await client.post(DIGITS, content=b"[" * 100_000 + b"]" * 100_000), 400, "nests too deeply")
        await assert_still_serving(client, digits_samples[0])


def test_json_depth_skips_strings_and_needs_no_recursion():
    assert json_depth(b"") == json_depth(b"3") == 0
    assert json_depth(b"[]") == 1 and json_depth(b'{"a": [1, {"b": []}]}') == 4
    assert json_depth(b'["[[[", "\\"[[", {"k]": "}"}]') == 2  # brackets in strings, escaped quotes
    assert json_depth(b"[" * ((1 << 20) + 5)) == (1 << 20) + 5  # across the scanner's chunks
    assert json_depth(b"[]" * 3_000_000) == 1


@pytest.mark.anyio
async def test_an_unexpected_engine_exception_is_a_json_500_without_traceback(digits_model, digits_samples,
                                                                              monkeypatch):
    from asyncinfer.serving.server import ServedModel

    original = ServedModel.infer

    async def broken(self, inputs):
        if inputs["image"].shape[0] == 2:
            raise RuntimeError("a bug deep inside /secret/path.py")
        return await original(self, inputs)

    monkeypatch.setattr(ServedModel, "infer", broken)
    app = create_app({"digits": digits_model})
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # as a real server: answer, log
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            response = await client.post(DIGITS, json=digits_request(digits_samples[0][:2]))
            assert_error(response, 500, "internal server error (RuntimeError)")
            assert "secret" not in response.text and "Traceback" not in response.text
            await assert_still_serving(client, digits_samples[0])


# -- deadlines: 504 and 408 ----------------------------------------------------------------------------
@pytest.fixture
def cancelled_runs(monkeypatch) -> list[Execution]:
    """Every ``Execution.cancel`` call (the engine skipping a run's layers not started)."""
    calls: list[Execution] = []
    original = Execution.cancel

    def spy(self: Execution) -> None:
        calls.append(self)
        original(self)

    monkeypatch.setattr(Execution, "cancel", spy)
    return calls


@pytest.mark.anyio
@pytest.mark.parametrize("batching", [False, True], ids=["alone", "batched"])
async def test_inference_past_the_deadline_is_504_and_the_run_is_cancelled(
        batching, gated_model, gated_batch_model, cancelled_runs, digits_model, digits_samples):
    model, gate = gated_batch_model if batching else gated_model
    async with serving({"slow": model, "digits": digits_model}, request_timeout=0.2, batching=batching) as client:
        try:
            response = await client.post("/v2/models/slow/infer", json=x_request())
            assert_error(response, 504, "model 'slow' did not answer within the request timeout (0.2 s)")
            await wait_until(lambda: len(cancelled_runs) == 1)  # the engine was told to stop
        finally:
            gate.set()
        # no deadline from here on: a good request must not race the clock on a busy machine
        client.app.state.admission.request_timeout = None  # type: ignore[attr-defined]
        # the same model answers once runs can finish
        response = await client.post("/v2/models/slow/infer", json=x_request())
        assert response.status_code == 200 and response.json()["outputs"][0]["data"] == [2.0] * 6
        await assert_still_serving(client, digits_samples[0])
        assert client.app.state.admission.active() == 0  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_a_body_that_does_not_arrive_in_time_is_408(digits_model, digits_samples):
    release = anyio.Event()

    async def stalled() -> AsyncIterator[bytes]:
        yield b'{"inputs": '
        await release.wait()
        yield b"[]}"

    body = stalled()
    async with serving({"digits": digits_model}, request_timeout=0.2) as client:
        try:
            assert_error(await client.post(DIGITS, content=body), 408, "did not arrive within the request timeout")
        finally:
            release.set()
            await body.aclose()
        client.app.state.admission.request_timeout = None  # type: ignore[attr-defined]
        await assert_still_serving(client, digits_samples[0])


# -- queue bound: 503 + Retry-After ------------------------------------------------------------------------
@pytest.mark.anyio
async def test_a_full_model_gets_503_with_retry_after_at_once(gated_model, digits_model, digits_samples):
    model, gate = gated_model
    async with serving({"slow": model, "digits": digits_model}, max_queue=2, threads=4) as client:
        admission = client.app.state.admission  # type: ignore[attr-defined]
        answers: list[httpx.Response] = []

        async def post() -> None:
            answers.append(await client.post("/v2/models/slow/infer", json=x_request()))

        try:
            async with anyio.create_task_group() as tg:
                for _ in range(2):
                    tg.start_soon(post)
                await wait_until(lambda: admission.active("slow") == 2)  # both held by the gate
                refused = await client.post("/v2/models/slow/infer", json=x_request())
                assert_error(refused, 503, "model 'slow' has 2 requests in progress, the most this server takes "
                                           "(max_queue=2)")
                assert refused.headers["retry-after"] == "1"
                await assert_still_serving(client, digits_samples[0])  # the bound is per model
                gate.set()
        finally:
            gate.set()
        assert [a.status_code for a in answers] == [200, 200]
        assert (await client.post("/v2/models/slow/infer", json=x_request())).status_code == 200


# -- graceful drain at shutdown ---------------------------------------------------------------------------
@asynccontextmanager
async def server_in_background(models: dict,
                               **options) -> AsyncIterator[tuple[httpx.AsyncClient, anyio.Event, anyio.Event]]:
    """Run the app's lifespan in a task of its own: yields (client, stop, stopped); set ``stop``
    to begin shutdown, ``stopped`` is set once it is over."""
    app = create_app(models, **options)
    started, stop, stopped = anyio.Event(), anyio.Event(), anyio.Event()

    async def lifespan() -> None:
        async with app.router.lifespan_context(app):
            started.set()
            await stop.wait()
        stopped.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(lifespan)
        await started.wait()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server") as client:
            client.app = app  # type: ignore[attr-defined]
            yield client, stop, stopped
        stop.set()


@pytest.mark.anyio
async def test_shutdown_lets_a_request_in_flight_finish_and_refuses_new_ones(gated_model):
    model, gate = gated_model
    answers: list[httpx.Response] = []
    async with server_in_background({"slow": model}, drain_timeout=HANG) as (client, stop, stopped):
        app = client.app  # type: ignore[attr-defined]
        entry, admission = app.state.models["slow"], app.state.admission

        async def post() -> None:
            answers.append(await client.post("/v2/models/slow/infer", json=x_request()))

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(post)
                await wait_until(lambda: admission.active() == 1)  # in the engine, held by the gate
                stop.set()  # shutdown begins while the request is in flight
                await wait_until(lambda: admission.draining)
                assert (await client.get("/v2/health/ready")).status_code == 503
                assert (await client.get("/v2/models/slow/ready")).json() == {"name": "slow", "ready": False}
                refused = await client.post("/v2/models/slow/infer", json=x_request())
                assert_error(refused, 503, "the server is shutting down")
                assert refused.headers["retry-after"] == "1"
                assert not stopped.is_set() and entry.ready  # still waiting: the worker is up
                gate.set()
                with anyio.fail_after(HANG):
                    await stopped.wait()
        finally:
            gate.set()  # on failure too, so the worker's threads can end
    assert [a.status_code for a in answers] == [200], answers[0].text
    assert answers[0].json()["outputs"][0]["data"] == [2.0] * 6
    assert not entry.ready  # disposed after the drain


@pytest.mark.anyio
async def test_a_request_still_running_when_the_drain_times_out_gets_503(gated_model, cancelled_runs):
    model, gate = gated_model
    answers: list[httpx.Response] = []
    async with server_in_background({"slow": model}, drain_timeout=0.2) as (client, stop, stopped):
        admission = client.app.state.admission  # type: ignore[attr-defined]

        async def post() -> None:
            answers.append(await client.post("/v2/models/slow/infer", json=x_request()))

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(post)
                await wait_until(lambda: admission.active() == 1)
                stop.set()
                await wait_until(lambda: bool(answers))  # answered although the gate is still shut
                assert_error(answers[0], 503, "the server shut down before this request finished")
                assert answers[0].headers["retry-after"] == "1" and cancelled_runs  # the run was cancelled
                gate.set()  # lets the gated kernel return, so the worker's threads can end
                with anyio.fail_after(HANG):
                    await stopped.wait()
        finally:
            gate.set()


# -- options -------------------------------------------------------------------------------------------------
def test_create_app_checks_its_options(digits_model):
    for options, error in [({"max_queue": 0}, "max_queue must be a positive integer or None"),
                           ({"request_timeout": 0}, "request_timeout must be a positive number"),
                           ({"drain_timeout": -1}, "drain_timeout must be >= 0"),
                           ({"drain_timeout": float("nan")}, "drain_timeout must be >= 0")]:
        with pytest.raises(ValueError, match=error):
            create_app({"digits": digits_model}, **options)
    with pytest.raises(TypeError, match="limits must be an asyncinfer.Limits"):
        create_app({"digits": digits_model}, limits={"max_request_bytes": 10})  # type: ignore[arg-type]
    app = create_app({"digits": digits_model}, request_timeout=None, max_queue=None)
    assert app.state.admission.deadline() == float("inf") and app.state.admission.max_queue is None


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers(dest="command"))
    return parser


def test_serve_options_reach_the_app(monkeypatch):
    import uvicorn

    args = serve_parser().parse_args(["serve", "--max-request-bytes", "1000", "--request-timeout", "0",
                                      "--max-queue", "3", "--drain-timeout", "2.5"])
    ran: dict = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: ran.update(app=app, **kwargs))
    assert run_serve(args) == 0
    state = ran["app"].state
    assert state.limits.max_request_bytes == 1000 and state.admission.request_timeout is None
    assert state.admission.max_queue == 3 and state.admission.drain_timeout == 2.5
    assert ran["timeout_graceful_shutdown"] == 3
    defaults = serve_parser().parse_args(["serve"])
    assert (defaults.max_request_bytes, defaults.request_timeout, defaults.max_queue, defaults.drain_timeout) == (
        ai.limits.DEFAULT_LIMITS.max_request_bytes, 60.0, 64, 30.0)


@pytest.mark.parametrize("argv", [["--max-request-bytes", "0"], ["--max-queue", "0"], ["--max-queue", "many"],
                                  ["--request-timeout", "-1"], ["--request-timeout", "nan"],
                                  ["--drain-timeout", "-0.5"], ["--drain-timeout", "inf"]])
def test_out_of_range_serve_options_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        serve_parser().parse_args(["serve", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument" in err and "Traceback" not in err


# -- property: whatever the body, a JSON answer of 200, 400 or 413 -------------------------------------------
FUZZ_LIMITS = ai.Limits().replace(max_request_bytes=8192, max_json_depth=16, max_tensor_elements=100_000)
LEAF = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6)
ANY_JSON = st.recursive(
    LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)
DIM = st.integers(0, 8) | st.integers() | st.floats() | st.text(max_size=2) | st.booleans() | st.none()
SHAPE = (st.sampled_from([[1, 1, 8, 8], [2, 1, 8, 8], [0, 1, 8, 8], [64], [1, 64]])
         | st.lists(DIM, max_size=40) | ANY_JSON)
DATATYPE = (st.sampled_from(["FP32", "FP16", "FP64", "INT64", "INT8", "UINT64", "BOOL", "BYTES", "BF16", "fp32", ""])
            | ANY_JSON)
NUMBER = st.floats(width=32) | st.integers() | st.booleans() | st.text(max_size=2)
DATA = (st.lists(st.floats(-2, 2, width=32), min_size=64, max_size=64) | st.lists(NUMBER, max_size=130)
        | st.lists(st.lists(NUMBER, max_size=8), max_size=9) | ANY_JSON)
PARAMETERS = st.dictionaries(st.sampled_from(["binary_data_size", "binary_data", "binary_data_output"]),
                             st.integers(-1, 300) | st.booleans() | ANY_JSON, max_size=2) | ANY_JSON
INPUT = st.fixed_dictionaries({"name": st.just("image") | ANY_JSON, "shape": SHAPE, "datatype": DATATYPE, "data": DATA},
                              optional={"parameters": PARAMETERS}) | ANY_JSON
OUTPUT = st.fixed_dictionaries({"name": st.sampled_from(["logits", "probabilities", "x"]) | ANY_JSON},
                               optional={"parameters": PARAMETERS}) | ANY_JSON
REQUEST = st.fixed_dictionaries({"inputs": st.lists(INPUT, min_size=1, max_size=2) | ANY_JSON},
                                optional={"id": st.text(max_size=5) | ANY_JSON, "outputs": st.lists(OUTPUT, max_size=3),
                                          "parameters": PARAMETERS}) | ANY_JSON
HEADER_TEXT = st.text(alphabet=string.ascii_letters + string.digits + string.punctuation + " ", max_size=24)
VALID = json.dumps({"inputs": [{"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32",
                                "data": [0.25] * 64}]}).encode()


@st.composite
def valid_requests(draw) -> tuple[bytes, dict[str, str], bool]:
    """A well-formed request of 0 to 3 images (any float32 values, NaN and inf included), as JSON
    or binary data, asking for some outputs as JSON or binary: it must succeed."""
    rows = draw(st.integers(0, 3))
    values = draw(st.lists(st.floats(width=32), min_size=64 * rows, max_size=64 * rows))
    tensor: dict = {"name": "image", "shape": [rows, 1, 8, 8], "datatype": "FP32"}
    request: dict = {"inputs": [tensor]}
    names = draw(st.lists(st.sampled_from(["logits", "probabilities"]), unique=True, max_size=2))
    if names:
        request["outputs"] = [{"name": n, "parameters": {"binary_data": draw(st.booleans())}} for n in names]
    if not draw(st.booleans()):
        tensor["data"] = values
        return json.dumps(request).encode(), {}, True
    tensor["parameters"] = {"binary_data_size": 256 * rows}
    header = json.dumps(request).encode()
    return header + np.array(values, np.float32).tobytes(), {"Inference-Header-Content-Length": str(len(header))}, True


@st.composite
def mutated_requests(draw) -> tuple[bytes, dict[str, str], bool]:
    """A request body and headers: a random request, random JSON, random bytes, a mutated or
    padded valid body, or a deep nesting; sometimes with binary data, a random header length or Content-Length."""
    kind = draw(st.sampled_from(["request", "json", "bytes", "mutated", "padded", "deep"]))
    if kind == "request":
        body = json.dumps(draw(REQUEST)).encode()
    elif kind == "json":
        body = json.dumps(draw(ANY_JSON)).encode()
    elif kind == "bytes":
        body = draw(st.binary(max_size=10_000))
    elif kind == "mutated":
        start = draw(st.integers(0, len(VALID)))
        end = draw(st.integers(start, min(len(VALID), start + 16)))
        body = VALID[:start] + draw(st.binary(max_size=8)) + VALID[end:]
    elif kind == "padded":  # around the body limit
        body = VALID + b" " * draw(st.integers(0, 2 * FUZZ_LIMITS.max_request_bytes))
    else:
        depth = draw(st.integers(1, 5000))
        body = draw(st.sampled_from([b"[", b'{"a":', b'{"inputs":['])) * depth
    headers: dict[str, str] = {}
    if draw(st.booleans()):  # the binary tensor data extension, with a random header length
        length = draw(st.integers(-3, len(body) + 3).map(str) | HEADER_TEXT)
        headers["Inference-Header-Content-Length"] = length
        body += draw(st.binary(max_size=300))
    if draw(st.integers(0, 9)) == 0:  # a Content-Length that lies
        headers["Content-Length"] = draw(st.integers(-1, 20_000).map(str) | HEADER_TEXT)
    return body, headers, False


BODIES = valid_requests() | mutated_requests() | mutated_requests()


@pytest.fixture(scope="module")
def post_to_digits(digits_model) -> Iterator[Callable[[bytes, dict[str, str]], httpx.Response]]:
    """A blocking ``post(body, headers)`` to one server kept up for the module (hypothesis runs
    the examples synchronously)."""
    app = create_app({"digits": digits_model}, limits=FUZZ_LIMITS, max_batch_size=4, max_delay=0)
    with anyio.from_thread.start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(app.router.lifespan_context(app)):
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server")

            def post(body: bytes, headers: dict[str, str]) -> httpx.Response:
                return portal.call(functools.partial(client.post, DIGITS, content=body, headers=headers))

            yield post
            portal.call(client.aclose)


def check_answer(post: Callable[[bytes, dict[str, str]], httpx.Response], body: bytes, headers: dict[str, str],
                 valid: bool) -> None:
    response = post(body, headers)  # a server bug raises here (httpx re-raises the app's exception)
    event(f"status {response.status_code}")  # the spread of answers: pytest --hypothesis-show-statistics
    assert response.status_code in ((200,) if valid else (200, 400, 413)), response.text[:500]
    if response.status_code == 200:
        length = int(response.headers.get("inference-header-content-length", len(response.content)))
        assert json.loads(response.content[:length])["model_name"] == "digits"
        return
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert isinstance(error, str) and error
    assert "could not be decoded" not in error, error  # the decoder's catch-all: a bug in it


FUZZ_SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                            HealthCheck.data_too_large])


@settings(max_examples=150, **FUZZ_SETTINGS)
@given(case=BODIES)
def test_any_body_gets_a_json_answer_of_200_400_or_413(post_to_digits, case):
    check_answer(post_to_digits, *case)


@pytest.mark.fuzz
@settings(max_examples=3000, **FUZZ_SETTINGS)
@given(case=BODIES)
def test_any_body_gets_a_json_answer_long_profile(post_to_digits, case):
    check_answer(post_to_digits, *case)
