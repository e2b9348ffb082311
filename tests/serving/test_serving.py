"""Serving: the DynamicBatcher (asyncio and trio) and the Open Inference Protocol server.

The server is driven through httpx's ASGI transport inside an explicit lifespan, and once for real
with uvicorn and Triton's own HTTP client. No timing assertions: batching is made deterministic
with batches that fill up (large ``max_delay``), never by racing the clock.
"""
from __future__ import annotations

import argparse
import json
import socket
import struct
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import httpx
import numpy as np
import pytest
from onnx import TensorProto, helper

import asyncinfer as ai
from asyncinfer.serving import DynamicBatcher, create_app
from asyncinfer.serving.batching import batch_symbol
from asyncinfer.serving.cli import add_serve_command, model_sources
from conftest import TEST_DOMAIN, make_model, tensor_info

RTOL, ATOL = 1e-5, 1e-5  # a batched GEMM may sum in another order than a batch of one (float32 ulps)


# -- models ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def int_model() -> ai.Model:
    """y = x + 1 (INT64), positive = x > 0 (BOOL); x is [N, 3] int64."""
    one = helper.make_tensor("one", TensorProto.INT64, [1], [1])
    zero = helper.make_tensor("zero", TensorProto.INT64, [1], [0])
    nodes = [helper.make_node("Add", ["x", "one"], ["y"]), helper.make_node("Greater", ["x", "zero"], ["positive"])]
    proto = make_model(nodes, [tensor_info("x", ["N", 3], TensorProto.INT64)],
                       [tensor_info("y", ["N", 3], TensorProto.INT64), tensor_info("positive", ["N", 3], TensorProto.BOOL)],
                       [one, zero], extra_domains=())
    return ai.load_model(proto)


@pytest.fixture
def gated_batch_model(gate):
    """y = Gate(x) + 1 on [N, 3]: runs cannot finish before the test opens the gate."""
    name, event = gate
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    nodes = [helper.make_node("Gate", ["x"], ["g"], domain=TEST_DOMAIN, gate=name),
             helper.make_node("Add", ["g", "one"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", ["N", 3])], [tensor_info("y", ["N", 3])], [one])
    return ai.load_model(proto), event


def count_runs(worker: ai.Worker) -> list[int]:
    """Wrap ``worker.run`` to record the batch size of every engine run."""
    sizes: list[int] = []
    original = worker.run

    async def counted(inputs, *args, **kwargs):
        sizes.append(int(next(iter(inputs.values())).shape[0]))
        return await original(inputs, *args, **kwargs)

    worker.run = counted  # type: ignore[method-assign]
    return sizes


# -- DynamicBatcher -------------------------------------------------------------------------------
def test_batch_symbol(digits_model, int_model, gated_model):
    assert batch_symbol(digits_model) == "N"
    assert batch_symbol(int_model) == "N"
    assert batch_symbol(gated_model[0]) is None  # fixed [2, 3]: every request runs alone


@pytest.mark.parametrize("declared", [["unk__12", 3], [-1, 3], ["?", "?"]])  # tf2onnx, Paddle2ONNX
def test_a_one_input_model_whose_axis_0_is_any_size_batches_and_two_such_inputs_do_not(declared):
    from onnx import helper as h

    one = ai.load_model(make_model([h.make_node("Relu", ["x"], ["y"])], [tensor_info("x", declared)],
                                   [tensor_info("y", declared)], extra_domains=()))
    assert one.inputs[0].shape[0] is None and batch_symbol(one) == "?"
    two = make_model([h.make_node("Add", ["a", "b"], ["y"])], [tensor_info("a", declared), tensor_info("b", declared)],
                     [tensor_info("y", declared)], extra_domains=())
    assert batch_symbol(ai.load_model(two)) is None  # unnamed axes of two inputs need not match


@pytest.mark.anyio
async def test_requests_to_a_model_with_an_any_size_batch_axis_are_merged():
    from onnx import helper as h

    model = ai.load_model(make_model([h.make_node("Relu", ["x"], ["y"])], [tensor_info("x", [-1, 3])],
                                     [tensor_info("y", [-1, 3])], extra_domains=()))
    async with ai.Worker(model) as worker:
        runs = count_runs(worker)
        async with DynamicBatcher(worker, max_batch_size=8, max_delay=30, eager=False) as batcher:
            results = {}

            async def one(i: int) -> None:
                results[i] = await batcher.infer({"x": np.full((1, 3), i - 2, np.float32)})

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(one, i)
                while batcher.pending < 4:
                    await anyio.sleep(0)
                await batcher.dispose_async()
        assert runs == [4]
        for i in range(4):
            np.testing.assert_array_equal(results[i]["y"], np.full((1, 3), max(i - 2, 0), np.float32))


@pytest.mark.anyio
async def test_concurrent_requests_are_batched_and_match_unbatched_runs(digits_model, digits_samples):
    images = digits_samples[0][:32]
    async with ai.Worker(digits_model) as worker:
        expected = [await worker.run({"image": images[i:i + 1]}) for i in range(32)]
        runs = count_runs(worker)
        results: list[dict | None] = [None] * 32
        # max_delay is long: the batch goes when full, so the grouping does not depend on timing
        async with DynamicBatcher(worker, max_batch_size=32, max_delay=30) as batcher:
            async def one(i: int) -> None:
                results[i] = await batcher.infer({"image": images[i:i + 1]})

            async with anyio.create_task_group() as tg:
                for i in range(32):
                    tg.start_soon(one, i)
        assert len(runs) < 32 and sum(runs) == 32
        assert batcher.stats.requests == 32 and batcher.stats.engine_runs == len(runs)
        for got, want in zip(results, expected):
            assert got is not None and set(got) == {"logits", "probabilities"}
            for name in want:
                assert got[name].shape == want[name].shape == (1, 10)
                np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL)
        assert not worker.disposed  # a worker it was given stays open


@pytest.mark.anyio
async def test_requests_of_several_rows_are_split_back(digits_model, digits_samples):
    images = digits_samples[0]
    sizes = [1, 3, 2, 4]
    starts = np.cumsum([0] + sizes[:-1])
    async with DynamicBatcher(digits_model, max_batch_size=10, max_delay=30) as batcher:
        results = {}

        async def one(i: int) -> None:
            results[i] = await batcher.infer({"image": images[starts[i]:starts[i] + sizes[i]]})

        async with anyio.create_task_group() as tg:
            for i in range(len(sizes)):
                tg.start_soon(one, i)
        assert batcher.stats.engine_runs == 1 and batcher.stats.max_rows == 10
        expected = await batcher.worker.run(images[:10])
    assert batcher.worker.disposed  # a worker the batcher built is disposed with it
    for i, n in enumerate(sizes):
        assert results[i]["probabilities"].shape == (n, 10)
        np.testing.assert_allclose(results[i]["probabilities"], expected["probabilities"][starts[i]:starts[i] + n],
                                   rtol=RTOL, atol=ATOL)


@pytest.mark.anyio
async def test_bad_requests_fail_alone(digits_model, digits_samples):
    images = digits_samples[0][:8]
    async with ai.Worker(digits_model) as worker:
        runs = count_runs(worker)
        async with DynamicBatcher(worker, max_batch_size=8, max_delay=30) as batcher:
            outcomes: dict[str, object] = {}

            async def call(key: str, inputs: dict) -> None:
                try:
                    outcomes[key] = await batcher.infer(inputs)
                except ai.AsyncInferError as exc:
                    outcomes[key] = exc

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(call, f"good{i}", {"image": images[i:i + 1]})
                tg.start_soon(call, "shape", {"image": np.zeros((1, 1, 7, 8), np.float32)})
                tg.start_soon(call, "dtype", {"image": images[:1].astype(np.float64)})
                tg.start_soon(call, "missing", {})
                tg.start_soon(call, "extra", {"image": images[:1], "other": images[:1]})
                for i in range(4, 8):
                    tg.start_soon(call, f"good{i}", {"image": images[i:i + 1]})
        assert runs == [8]  # the eight good requests went together
    for i in range(8):
        assert isinstance(outcomes[f"good{i}"], dict)
    assert isinstance(outcomes["shape"], ai.InputError) and "axis 2 is 7, expected 8" in str(outcomes["shape"])
    assert isinstance(outcomes["dtype"], ai.InputError) and "must be float32, got float64" in str(outcomes["dtype"])
    assert isinstance(outcomes["missing"], ai.InputError) and "missing input(s) ['image']" in str(outcomes["missing"])
    assert isinstance(outcomes["extra"], ai.InputError) and "unknown input(s) ['other']" in str(outcomes["extra"])


@pytest.mark.anyio
async def test_an_engine_failure_stays_with_its_request(picky_model):
    async with ai.Worker(picky_model) as worker:
        runs = count_runs(worker)
        async with DynamicBatcher(worker, max_batch_size=4, max_delay=30) as batcher:
            outcomes: dict[int, object] = {}

            async def call(i: int, value: float) -> None:
                try:
                    outcomes[i] = await batcher.infer({"x": np.full((1, 3), value, np.float32)})
                except ai.ExecutionError as exc:
                    outcomes[i] = exc

            async with anyio.create_task_group() as tg:
                for i, value in enumerate([1.0, 2.0, -1.0, 3.0]):
                    tg.start_soon(call, i, value)
        assert runs == [4, 1, 1, 1, 1]  # the merged run failed, so each request was retried alone
    for i, value in [(0, 1.0), (1, 2.0), (3, 3.0)]:
        np.testing.assert_array_equal(outcomes[i]["y"], np.full((1, 3), 2 * value, np.float32))
    assert isinstance(outcomes[2], ai.ExecutionError) and "negative value" in str(outcomes[2])


@pytest.mark.anyio
async def test_a_cancelled_waiting_request_leaves_the_others_alone(digits_model, digits_samples):
    images = digits_samples[0][:5]
    async with ai.Worker(digits_model) as worker:
        runs = count_runs(worker)
        # not eager: the requests wait in the queue for their batch, where one is cancelled
        async with DynamicBatcher(worker, max_batch_size=4, max_delay=30, eager=False) as batcher:
            cancelled = anyio.Event()

            async def doomed(scope_holder: list) -> None:
                with anyio.CancelScope() as scope:
                    scope_holder.append(scope)
                    await batcher.infer({"image": images[4:5]})
                cancelled.set()

            results: dict[int, dict] = {}

            async def good(i: int) -> None:
                results[i] = await batcher.infer({"image": images[i:i + 1]})

            async with anyio.create_task_group() as tg:
                holder: list = []
                tg.start_soon(doomed, holder)
                tg.start_soon(good, 0)
                while batcher.pending < 2:
                    await anyio.sleep(0)
                holder[0].cancel()  # waiting in the queue, not sent yet
                await cancelled.wait()
                assert batcher.pending == 1
                for i in range(1, 4):  # fills the batch of 4 without the cancelled request
                    tg.start_soon(good, i)
        assert runs == [4]
        for i in range(4):
            np.testing.assert_allclose(results[i]["probabilities"],
                                       (await worker.run({"image": images[i:i + 1]}))["probabilities"],
                                       rtol=RTOL, atol=ATOL)


@pytest.mark.anyio
async def test_a_request_cancelled_in_flight_does_not_disturb_its_batch_mates(gated_batch_model):
    model, gate = gated_batch_model
    async with DynamicBatcher(model, max_batch_size=2, max_delay=30) as batcher:
        results: dict[str, object] = {}

        async def call(key: str, value: float, scope_holder: list | None = None) -> None:
            with anyio.CancelScope() as scope:
                if scope_holder is not None:
                    scope_holder.append(scope)
                results[key] = await batcher.infer({"x": np.full((1, 3), value, np.float32)})
                return
            results[key] = "cancelled"

        async with anyio.create_task_group() as tg:
            holder: list = []
            tg.start_soon(call, "doomed", 1.0, holder)
            tg.start_soon(call, "kept", 2.0)
            while batcher.stats.engine_runs < 1:  # both went into one run, held by the gate
                await anyio.sleep(0)
            holder[0].cancel()
            while "doomed" not in results:
                await anyio.sleep(0)
            gate.set()
        assert results["doomed"] == "cancelled"
        np.testing.assert_array_equal(results["kept"]["y"], np.full((1, 3), 3.0, np.float32))
        assert batcher.stats.engine_runs == 1


@pytest.mark.anyio
async def test_dispose_async_drains_pending_requests_then_refuses_new_ones(digits_model, digits_samples):
    images = digits_samples[0][:3]
    async with ai.Worker(digits_model) as worker:
        runs = count_runs(worker)
        batcher = DynamicBatcher(worker, max_batch_size=32, max_delay=30, eager=False)  # the requests wait
        results: dict[int, dict] = {}
        async with batcher:
            async def one(i: int) -> None:
                results[i] = await batcher.infer({"image": images[i:i + 1]})

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(one, i)
                while batcher.pending < 3:
                    await anyio.sleep(0)
                await batcher.dispose_async()  # the batch is far from full and the delay far away: drained now
        assert runs == [3] and sorted(results) == [0, 1, 2]
        with pytest.raises(ai.DisposedError, match="closed"):
            await batcher.infer({"image": images[:1]})


@pytest.mark.anyio
async def test_unbatchable_models_run_each_request_alone(gated_model):
    model, gate = gated_model
    gate.set()
    async with DynamicBatcher(model, max_batch_size=8, max_delay=30) as batcher:
        assert not batcher.batchable
        results = []

        async def one() -> None:
            results.append(await batcher.infer({"x": np.ones((2, 3), np.float32)}))

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(one)
        assert batcher.stats.engine_runs == 3 and len(results) == 3


@pytest.mark.anyio
async def test_infer_needs_a_started_batcher(digits_model):
    batcher = DynamicBatcher(digits_model)
    with pytest.raises(ai.DisposedError, match="async with DynamicBatcher"):
        await batcher.infer({"image": np.zeros((1, 1, 8, 8), np.float32)})
    await batcher.dispose_async()
    assert batcher.worker.disposed


# -- the server through the ASGI transport --------------------------------------------------------
@asynccontextmanager
async def serving(models: dict, **options) -> AsyncIterator[httpx.AsyncClient]:
    """A client of ``create_app(models)`` with the app's lifespan (startup/shutdown) around it."""
    app = create_app(models, **options)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            client.app = app  # type: ignore[attr-defined]
            yield client


def binary_request(request: dict, chunks: list[bytes]) -> tuple[bytes, dict[str, str]]:
    header = json.dumps(request).encode()
    return header + b"".join(chunks), {"Inference-Header-Content-Length": str(len(header))}


def decode_outputs(response: httpx.Response) -> dict[str, np.ndarray]:
    """Output arrays of an infer response, JSON or binary."""
    dtypes = {"FP32": np.float32, "INT64": np.int64, "BOOL": np.bool_}
    length = response.headers.get("inference-header-content-length")
    header = json.loads(response.content[:int(length)] if length else response.content)
    offset = int(length or 0)
    arrays = {}
    for out in header["outputs"]:
        dtype = dtypes[out["datatype"]]
        size = out.get("parameters", {}).get("binary_data_size")
        if size is None:
            arrays[out["name"]] = np.asarray(out["data"], dtype).reshape(out["shape"])
        else:
            raw = response.content[offset:offset + size]
            offset += size
            arrays[out["name"]] = np.frombuffer(raw, dtype).reshape(out["shape"])
    return arrays


@pytest.mark.anyio
async def test_health_and_metadata_endpoints(digits_model):
    async with serving({"digits": digits_model}) as client:
        assert (await client.get("/v2/health/live")).json() == {"live": True}
        ready = await client.get("/v2/health/ready")
        assert ready.status_code == 200 and ready.json() == {"ready": True}
        meta = (await client.get("/v2")).json()
        assert meta["name"] == "asyncinfer" and meta["version"] == ai.__version__
        assert "binary_tensor_data" in meta["extensions"]
        expected = {
            "name": "digits", "versions": ["1"], "platform": "onnx",
            "inputs": [{"name": "image", "datatype": "FP32", "shape": [-1, 1, 8, 8]}],
            "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]},
                        {"name": "probabilities", "datatype": "FP32", "shape": [-1, 10]}],
        }
        for path in ("/v2/models/digits", "/v2/models/digits/versions/1"):
            assert (await client.get(path)).json() == expected
        for path in ("/v2/models/digits/ready", "/v2/models/digits/versions/1/ready"):
            response = await client.get(path)
            assert response.status_code == 200 and response.json() == {"name": "digits", "ready": True}


@pytest.mark.anyio
@pytest.mark.parametrize("freeze", [False, True])
async def test_freeze_heap_puts_the_loaded_models_out_of_the_collectors_reach(digits_model, freeze):
    """``freeze_heap`` (what `asyncinfer serve` sets) freezes the heap once the service runs, so
    that full collections skip its models and workers; by default the process's heap is left
    alone. The service serves either way."""
    import gc

    from asyncinfer.serving.service import InferenceService

    gc.unfreeze()
    try:
        async with serving({}, service=InferenceService({"digits": digits_model}, freeze_heap=freeze)) as client:
            assert (gc.get_freeze_count() > 0) is freeze
            assert (await client.get("/v2/health/ready")).json() == {"ready": True}
    finally:
        gc.unfreeze()  # (the rest of the test session collects as before)


@pytest.mark.anyio
async def test_json_infer_matches_worker_run(digits_model, digits_samples):
    images = digits_samples[0][:3]
    async with ai.Worker(digits_model) as worker:
        expected = await worker.run(images)
    async with serving({"digits": digits_model}) as client:
        for path, data in [("/v2/models/digits/infer", images.ravel().tolist()),  # flat
                           ("/v2/models/digits/versions/1/infer", images.tolist())]:  # nested
            response = await client.post(path, json={
                "id": "req-7", "inputs": [{"name": "image", "shape": [3, 1, 8, 8], "datatype": "FP32", "data": data}]})
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["model_name"] == "digits" and body["id"] == "req-7"
            assert [o["name"] for o in body["outputs"]] == ["logits", "probabilities"]
            assert all(o["datatype"] == "FP32" and o["shape"] == [3, 10] for o in body["outputs"])
            got = decode_outputs(response)
            for name in expected:
                np.testing.assert_allclose(got[name], expected[name], rtol=RTOL, atol=ATOL)
        # only the outputs asked for, in the order asked
        response = await client.post("/v2/models/digits/infer", json={
            "inputs": [{"name": "image", "shape": [3, 1, 8, 8], "datatype": "FP32", "data": images.ravel().tolist()}],
            "outputs": [{"name": "probabilities"}]})
        assert [o["name"] for o in response.json()["outputs"]] == ["probabilities"]
        assert "id" not in response.json()


@pytest.mark.anyio
async def test_binary_infer_matches_worker_run(digits_model, digits_samples):
    images = digits_samples[0][:4]
    async with ai.Worker(digits_model) as worker:
        expected = await worker.run(images)
    inputs = [{"name": "image", "shape": [4, 1, 8, 8], "datatype": "FP32",
               "parameters": {"binary_data_size": images.nbytes}}]
    async with serving({"digits": digits_model}) as client:
        # binary in, binary out (request-wide parameter)
        content, headers = binary_request({"inputs": inputs, "parameters": {"binary_data_output": True}},
                                          [images.tobytes()])
        response = await client.post("/v2/models/digits/infer", content=content, headers=headers)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "application/octet-stream"
        got = decode_outputs(response)
        for name in expected:
            np.testing.assert_allclose(got[name], expected[name], rtol=RTOL, atol=ATOL)
        # binary in; one output binary, the other JSON (per-output parameter)
        content, headers = binary_request({"inputs": inputs, "outputs": [
            {"name": "logits", "parameters": {"binary_data": True}}, {"name": "probabilities"}]}, [images.tobytes()])
        response = await client.post("/v2/models/digits/infer", content=content, headers=headers)
        outputs = json.loads(response.content[:int(response.headers["inference-header-content-length"])])["outputs"]
        assert outputs[0]["parameters"] == {"binary_data_size": 4 * 10 * 4} and "data" not in outputs[0]
        assert "data" in outputs[1]
        got = decode_outputs(response)
        np.testing.assert_allclose(got["logits"], expected["logits"], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(got["probabilities"], expected["probabilities"], rtol=RTOL, atol=ATOL)
        # JSON in, binary out
        response = await client.post("/v2/models/digits/infer", json={
            "inputs": [{"name": "image", "shape": [4, 1, 8, 8], "datatype": "FP32", "data": images.ravel().tolist()}],
            "outputs": [{"name": "probabilities", "parameters": {"binary_data": True}}]})
        np.testing.assert_allclose(decode_outputs(response)["probabilities"], expected["probabilities"],
                                   rtol=RTOL, atol=ATOL)


@pytest.mark.anyio
async def test_two_models_served_at_once(digits_model, int_model, digits_samples):
    images = digits_samples[0][:2]
    async with ai.Worker(digits_model) as worker:
        expected = await worker.run(images)
    x = np.array([[-1, 0, 5], [7, -3, 2]], np.int64)
    async with serving({"digits": digits_model, "plus_one": int_model}) as client:
        meta = (await client.get("/v2/models/plus_one")).json()
        assert meta["inputs"] == [{"name": "x", "datatype": "INT64", "shape": [-1, 3]}]
        assert meta["outputs"] == [{"name": "y", "datatype": "INT64", "shape": [-1, 3]},
                                   {"name": "positive", "datatype": "BOOL", "shape": [-1, 3]}]
        responses = {}

        async def post(name: str, request: dict) -> None:
            responses[name] = await client.post(f"/v2/models/{name}/infer", json=request)

        async with anyio.create_task_group() as tg:
            tg.start_soon(post, "digits", {"inputs": [
                {"name": "image", "shape": [2, 1, 8, 8], "datatype": "FP32", "data": images.ravel().tolist()}]})
            tg.start_soon(post, "plus_one", {"inputs": [
                {"name": "x", "shape": [2, 3], "datatype": "INT64", "data": x.tolist()}]})
        got = decode_outputs(responses["plus_one"])
        np.testing.assert_array_equal(got["y"], x + 1)
        np.testing.assert_array_equal(got["positive"], x > 0)
        assert responses["plus_one"].json()["outputs"][1]["data"] == (x > 0).ravel().tolist()  # JSON booleans
        np.testing.assert_allclose(decode_outputs(responses["digits"])["logits"], expected["logits"],
                                   rtol=RTOL, atol=ATOL)
        # binary BOOL/INT64 too
        content, headers = binary_request({"inputs": [{"name": "x", "shape": [2, 3], "datatype": "INT64",
                                                       "parameters": {"binary_data_size": x.nbytes}}],
                                           "parameters": {"binary_data_output": True}}, [x.tobytes()])
        got = decode_outputs(await client.post("/v2/models/plus_one/infer", content=content, headers=headers))
        np.testing.assert_array_equal(got["positive"], x > 0)


def image_input(shape=(1, 1, 8, 8), datatype="FP32", data=None, **extra) -> dict:
    count = int(np.prod(shape))
    return {"name": "image", "shape": list(shape), "datatype": datatype,
            "data": [0.5] * count if data is None else data, **extra}


BAD_REQUESTS = [
    # (path, json body or raw bytes, extra headers, status, message fragment)
    ("/v2/models/nope/infer", {"inputs": [image_input()]}, {}, 404, "unknown model 'nope'; this server has ['digits', 'plus_one']"),
    ("/v2/models/digits/versions/3/infer", {"inputs": [image_input()]}, {}, 404, "model 'digits' has no version '3'"),
    ("/v2/models/digits/infer", b"{not json", {}, 400, "malformed JSON in the request body"),
    ("/v2/models/digits/infer", b"[1, 2]", {}, 400, "the request body must be a JSON object, got list"),
    ("/v2/models/digits/infer", {"inputs": []}, {}, 400, "the request needs 'inputs': a non-empty list of tensors"),
    ("/v2/models/digits/infer", {"inputs": [{"name": "image", "shape": [1, 1, 8, 8], "data": [0] * 64}]}, {}, 400,
     "inputs[0] has no 'datatype'"),
    ("/v2/models/digits/infer", {"inputs": [image_input(datatype="INT64", data=[0] * 64)]}, {}, 400,
     "input 'image' has datatype FP32 in model 'digits', the request says INT64"),
    ("/v2/models/digits/infer", {"inputs": [image_input(datatype="FLOAT")]}, {}, 400, "unknown datatype 'FLOAT'"),
    ("/v2/models/digits/infer", {"inputs": [image_input(shape=(1, 1, 8, 7))]}, {}, 400,
     "input 'image' must have shape (N, 1, 8, 8), got (1, 1, 8, 7) (axis 3 is 7, expected 8)"),
    ("/v2/models/digits/infer", {"inputs": [image_input(shape=(1, 64))]}, {}, 400, "input 'image' must have rank 4"),
    ("/v2/models/digits/infer", {"inputs": [image_input(shape=(1, -1, 8, 8), data=[0.5] * 64)]}, {}, 400,
     "'shape' must be a list of non-negative integers"),
    ("/v2/models/digits/infer", {"inputs": [image_input(data=[0.5] * 63)]}, {}, 400,
     "input 'image': shape [1, 1, 8, 8] needs 64 elements, 'data' has 63"),
    ("/v2/models/digits/infer", {"inputs": [image_input(data=["a"] * 64)]}, {}, 400,
     "input 'image': FP32 data must be numbers, got strings"),
    ("/v2/models/digits/infer", {"inputs": [image_input(data=[[0.5] * 3, [0.5] * 61])]}, {}, 400,
     "input 'image': 'data' is not a regular (flat or nested) list"),
    ("/v2/models/digits/infer", {"inputs": [image_input(), image_input()]}, {}, 400, "input 'image' is given twice"),
    ("/v2/models/digits/infer", {"inputs": [dict(image_input(), name="pixels")]}, {}, 400,
     "unknown input 'pixels'; model 'digits' takes ['image']"),
    ("/v2/models/plus_one/infer", {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "INT64", "data": [1.5, 2, 3]}]},
     {}, 400, "input 'x': INT64 data must be integers, got non-integer numbers"),
    ("/v2/models/digits/infer", {"inputs": [image_input()], "outputs": [{"name": "scores"}]}, {}, 400,
     "unknown output 'scores'; model 'digits' has outputs ['logits', 'probabilities']"),
    ("/v2/models/digits/infer", {"inputs": [image_input(data=None, parameters={"binary_data_size": 256})]},
     {"Inference-Header-Content-Length": "nope"}, 400, "Inference-Header-Content-Length must be an integer"),
    ("/v2/models/digits/infer", {"inputs": [image_input(parameters={"binary_data_size": 256})]},
     {"Inference-Header-Content-Length": "100000"}, 400, "Inference-Header-Content-Length is 100000, but the body has"),
]


@pytest.mark.anyio
async def test_bad_requests_get_a_json_error_and_the_server_stays_up(digits_model, int_model, digits_samples):
    async with serving({"digits": digits_model, "plus_one": int_model}) as client:
        for path, body, headers, status, message in BAD_REQUESTS:
            if isinstance(body, dict):
                body = json.dumps(body).encode()
            response = await client.post(path, content=body, headers=headers)
            assert response.status_code == status, (path, response.text)
            assert message in response.json()["error"], (message, response.json())
        # binary data whose size does not fit the declared shape, and missing binary bytes
        image = np.zeros((1, 1, 8, 8), np.float32)
        for size, chunk, message in [(100, image.tobytes()[:100], "shape needs 64 elements = 256 bytes of FP32, 'binary_data_size' is 100"),
                                     (256, image.tobytes()[:200], "'binary_data_size' is 256, but only 200 bytes"),
                                     (256, image.tobytes() + b"xx", "the body has 258 bytes of binary tensor data")]:
            content, headers = binary_request({"inputs": [{"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32",
                                                           "parameters": {"binary_data_size": size}}]}, [chunk])
            response = await client.post("/v2/models/digits/infer", content=content, headers=headers)
            assert response.status_code == 400 and message in response.json()["error"], response.text
        missing = await client.post("/v2/models/plus_one/infer", json={"inputs": [image_input()]})
        assert missing.status_code == 400 and "unknown input 'image'; model 'plus_one' takes ['x']" in missing.json()["error"]
        for method, path, status in [("GET", "/v2/models/nope", 404), ("GET", "/v2/models/nope/ready", 404),
                                     ("GET", "/v2/nothing/here", 404), ("GET", "/v2/models/digits/infer", 405)]:
            response = await client.request(method, path)
            assert response.status_code == status and response.json()["error"], response.text
        # still serving
        assert (await client.get("/v2/health/ready")).status_code == 200
        response = await client.post("/v2/models/digits/infer", json={"inputs": [
            image_input(data=digits_samples[0][:1].ravel().tolist())]})
        assert response.status_code == 200 and response.json()["outputs"][0]["shape"] == [1, 10]


@pytest.mark.anyio
async def test_concurrent_http_requests_are_batched(digits_model, digits_samples):
    images = digits_samples[0][:16]
    async with ai.Worker(digits_model) as worker:
        expected = await worker.run(images)
    async with serving({"digits": digits_model}, max_batch_size=16, max_delay=30) as client:
        responses: dict[int, httpx.Response] = {}

        async def post(i: int) -> None:
            responses[i] = await client.post("/v2/models/digits/infer", json={"inputs": [
                {"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": images[i].ravel().tolist()}]})

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(post, i)
        stats = client.app.state.models["digits"].batcher.stats  # type: ignore[attr-defined]
        assert stats.requests == 16 and stats.engine_runs < 16
        for i in range(16):
            np.testing.assert_allclose(decode_outputs(responses[i])["probabilities"][0], expected["probabilities"][i],
                                       rtol=RTOL, atol=ATOL)


@pytest.mark.anyio
async def test_without_batching_every_request_runs_on_the_worker(digits_model, digits_samples):
    async with serving({"digits": digits_model}, batching=False) as client:
        entry = client.app.state.models["digits"]  # type: ignore[attr-defined]
        assert entry.batcher is None and entry.ready
        response = await client.post("/v2/models/digits/infer", json={"inputs": [
            image_input(data=digits_samples[0][:1].ravel().tolist())]})
        assert response.status_code == 200
    assert not entry.ready  # the worker was disposed at shutdown


# -- the real server, with Triton's client --------------------------------------------------------
def test_uvicorn_server_with_tritonclient(digits_model, digits_samples):
    try:
        import tritonclient.http as triton
    except ImportError as exc:  # pragma: no cover - a dev dependency
        pytest.skip(f"tritonclient[http] is not importable: {exc}")
    import uvicorn

    images = digits_samples[0][:3]
    with ai.Worker(digits_model) as worker:
        expected = worker.run_blocking(images)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # a free port, held from the start: no race with other processes
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app({"digits": digits_model}), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(1000):  # up to 10 s
            if server.started or not thread.is_alive():
                break
            threading.Event().wait(0.01)
        assert server.started, "uvicorn did not start"
        client = triton.InferenceServerClient(f"127.0.0.1:{port}", connection_timeout=10, network_timeout=10)
        try:
            assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("digits")
            meta = client.get_model_metadata("digits")
            assert meta["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
            for binary in (True, False):
                tensor = triton.InferInput("image", list(images.shape), "FP32")
                tensor.set_data_from_numpy(images, binary_data=binary)
                wanted = [triton.InferRequestedOutput(n, binary_data=binary) for n in ("logits", "probabilities")]
                result = client.infer("digits", [tensor], outputs=wanted, request_id="r1")
                assert result.get_response()["id"] == "r1"
                for name in expected:
                    np.testing.assert_allclose(result.as_numpy(name), expected[name], rtol=RTOL, atol=ATOL)
            # no outputs named: Triton's client asks for every output as binary data
            tensor = triton.InferInput("image", list(images.shape), "FP32")
            tensor.set_data_from_numpy(images)
            result = client.infer("digits", [tensor])
            np.testing.assert_allclose(result.as_numpy("probabilities"), expected["probabilities"], rtol=RTOL, atol=ATOL)
            with pytest.raises(triton.InferenceServerException, match="unknown model 'nope'"):
                client.get_model_metadata("nope")
        finally:
            client.close()
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
    assert not thread.is_alive(), "uvicorn did not stop"


# -- command line ---------------------------------------------------------------------------------
def test_serve_command_arguments(tmp_path):
    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "a.onnx", "--port", "9001", "--no-batching", "--max-delay-ms", "5"])
    assert (args.command, args.models, args.port, args.host) == ("serve", ["a.onnx"], 9001, "127.0.0.1")
    assert args.no_batching and args.max_delay_ms == 5 and args.max_batch_size == 32 and args.backend == "cpu"
    assert set(model_sources(["models/resnet.onnx", "small=models/other.onnx"])) == {"resnet", "small"}
    assert list(model_sources([])) == ["digits"]
    with pytest.raises(ai.AsyncInferError, match="two models would be served as 'resnet'"):
        model_sources(["a/resnet.onnx", "b/resnet.onnx"])


def test_byte_strings_pack_with_length_prefixes():
    from asyncinfer.serving.protocol import _to_binary, unpack_bytes

    values = np.array([b"ab", b"", "héllo".encode()], dtype=object)
    packed = _to_binary(values)
    assert packed[:4] == struct.pack("<I", 2)
    assert list(unpack_bytes("s", packed, 3)) == list(values)


def test_serving_benchmark_smoke():
    """bench/serving.py runs with tiny sizes and returns well-formed numbers (no timing asserted)."""
    import asyncio
    import math
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.insert(0, root)
    from bench import serving as serving_bench

    proto, inputs = serving_bench.model_and_input("digits")
    result = asyncio.run(serving_bench.measure_model_async(proto, inputs, clients=4, requests=8, rounds=1))
    assert set(result["modes"]) == set(serving_bench.MODES)
    for mode in result["modes"].values():
        assert mode["throughput_rps"] > 0 and 0 <= mode["p50_ms"] <= mode["p99_ms"] <= mode["max_ms"]
    assert math.isfinite(result["modes"]["batched"]["requests_per_engine_run"])


@pytest.mark.anyio
async def test_an_overridable_initializer_is_an_optional_input():
    """IR >= 4: an initializer listed among the graph inputs has a default; a request may leave it
    out (the default is used) or send it (overriding it), as ONNX Runtime and Triton allow."""
    k = helper.make_tensor("k", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])
    proto = make_model([helper.make_node("Mul", ["x", "k"], ["y"])],
                       [tensor_info("x", ["N", 3]), tensor_info("k", [3])], [tensor_info("y", ["N", 3])], [k],
                       extra_domains=())
    model = ai.load_model(proto)
    assert "k" in model.input_defaults
    x = [[1.0, 1.0, 1.0]]
    async with serving({"scale": model}) as client:
        response = await client.post("/v2/models/scale/infer", json={
            "inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": x}]})
        assert response.status_code == 200, response.text
        np.testing.assert_array_equal(decode_outputs(response)["y"], [[1.0, 2.0, 3.0]])
        response = await client.post("/v2/models/scale/infer", json={
            "inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": x},
                       {"name": "k", "shape": [3], "datatype": "FP32", "data": [5.0, 5.0, 5.0]}]})
        assert response.status_code == 200, response.text
        np.testing.assert_array_equal(decode_outputs(response)["y"], [[5.0, 5.0, 5.0]])
        config = (await client.get("/v2/models/scale/config")).json()
        assert {i["name"]: i["optional"] for i in config["input"]} == {"x": False, "k": True}
        response = await client.post("/v2/models/scale/infer", json={
            "inputs": [{"name": "k", "shape": [3], "datatype": "FP32", "data": [5.0, 5.0, 5.0]}]})
        assert response.status_code == 400 and "missing input(s) ['x']" in response.text
