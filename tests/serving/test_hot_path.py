"""What the inference hot path skips must not change an answer: the remembered header plans,
the hand-written response JSON, the batcher's checked request keys and the ASGI fast path."""
from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from onnx import helper

import asyncinfer as ai
from asyncinfer.errors import InputError, RequestTooLargeError
from asyncinfer.serving import DynamicBatcher, create_app
from asyncinfer.serving.protocol import (HeaderPlans, InferRequest, ProtocolError, encode_infer_response,
                                         parse_infer_request)
from conftest import make_model, tensor_info


def binary_body(images: np.ndarray, request_id: str | None = "", outputs: bool = True) -> tuple[bytes, str]:
    header = {"inputs": [{"name": "image", "datatype": "FP32", "shape": list(images.shape),
                          "parameters": {"binary_data_size": images.nbytes}}]}
    if request_id is not None:
        header = {"id": request_id, **header}
    if outputs:
        header["outputs"] = [{"name": "probabilities", "parameters": {"binary_data": True}}, {"name": "logits"}]
    head = json.dumps(header).encode()
    return head + images.astype("<f4").tobytes(), str(len(head))


def same_request(a: InferRequest, b: InferRequest) -> None:
    assert (a.id, a.outputs, a.binary) == (b.id, b.outputs, b.binary)
    assert a.inputs.keys() == b.inputs.keys()
    for name in a.inputs:
        assert a.inputs[name].dtype == b.inputs[name].dtype
        np.testing.assert_array_equal(a.inputs[name], b.inputs[name])


# -- header plans --------------------------------------------------------------------------------------
def test_a_remembered_header_decodes_as_a_fresh_parse(digits_model, digits_samples):
    plans = HeaderPlans()
    first, length = binary_body(digits_samples[0][:2], "a")
    again, _ = binary_body(digits_samples[0][2:4], "a")  # same header, other tensor bytes
    same_request(parse_infer_request(first, length, digits_model, plans=plans), parse_infer_request(first, length,
                                                                                                    digits_model))
    assert len(plans) == 1
    reused = parse_infer_request(again, length, digits_model, plans=plans)
    same_request(reused, parse_infer_request(again, length, digits_model))
    reused.inputs["image"][...] = 0  # each request owns its arrays: the body and the plan are untouched
    np.testing.assert_array_equal(parse_infer_request(again, length, digits_model, plans=plans).inputs["image"],
                                  digits_samples[0][2:4])


def test_a_remembered_header_with_the_wrong_data_size_is_parsed_again_for_its_error(digits_model, digits_samples):
    plans = HeaderPlans()
    body, length = binary_body(digits_samples[0][:1])
    parse_infer_request(body, length, digits_model, plans=plans)
    with pytest.raises(ProtocolError) as caught:
        parse_infer_request(body[:-4], length, digits_model, plans=plans)
    with pytest.raises(ProtocolError) as fresh:
        parse_infer_request(body[:-4], length, digits_model)
    assert caught.value.status == fresh.value.status == 400 and caught.value.message == fresh.value.message


def test_headers_with_json_data_are_not_remembered_and_the_plans_are_bounded(digits_model, digits_samples):
    plans = HeaderPlans(capacity=2)
    json_body = json.dumps({"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8],
                                        "data": digits_samples[0][:1].ravel().tolist()}]}).encode()
    parse_infer_request(json_body, str(len(json_body)), digits_model, plans=plans)
    assert len(plans) == 0
    for request_id in "abc":
        body, length = binary_body(digits_samples[0][:1], request_id)
        assert parse_infer_request(body, length, digits_model, plans=plans).id == request_id
    assert len(plans) == 2


# -- the response JSON ---------------------------------------------------------------------------------
@pytest.mark.parametrize("request_id", [None, "", "r-1", 'quote " and ünïcode'])
def test_the_response_json_is_what_json_dumps_writes(request_id):
    outputs = {"ünï \"name\"": np.arange(6, dtype=np.float32).reshape(2, 3) / 7, "flags": np.array([True, False]),
               "big": np.array([[1 << 40]], dtype=np.int64), "words": np.array([b"a", "é".encode()], dtype=object),
               "nan": np.array([np.nan, np.inf], dtype=np.float64)}
    binary = {"ünï \"name\"": True, "flags": False, "big": True, "words": False, "nan": False}
    request = InferRequest(request_id, {}, list(outputs), binary)
    body, headers = encode_infer_response("mödel", "3", request, outputs)
    header = body[:int(headers["inference-header-content-length"])]
    tensors = []
    for name, array in outputs.items():
        tensor = {"name": name, "datatype": {"ünï \"name\"": "FP32", "flags": "BOOL", "big": "INT64", "words": "BYTES",
                                             "nan": "FP64"}[name], "shape": list(array.shape)}
        if binary[name]:
            tensor["parameters"] = {"binary_data_size": array.nbytes}
        else:
            tensor["data"] = [v.decode() for v in array.ravel()] if name == "words" else array.ravel().tolist()
        tensors.append(tensor)
    expected = {"model_name": "mödel", "model_version": "3", "outputs": tensors}
    if request_id is not None:
        expected["id"] = request_id
    assert header == json.dumps(expected, separators=(",", ":")).encode()


# -- the batcher's checked keys ------------------------------------------------------------------------
@pytest.mark.anyio
async def test_a_checked_request_shape_still_checks_limits_and_other_shapes():
    relu = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", ["N", 4])],
                      [tensor_info("y", ["N", 4])])
    small = ai.load_model(relu, limits=ai.Limits(max_tensor_elements=12))
    x = np.arange(-8, 8, dtype=np.float32).reshape(4, 4)
    async with DynamicBatcher(small, max_batch_size=8) as batcher:
        np.testing.assert_array_equal((await batcher.infer({"x": x[:2]}))["y"], np.maximum(x[:2], 0))  # checked
        np.testing.assert_array_equal((await batcher.infer({"x": x[1:2]}))["y"], np.maximum(x[1:2], 0))
        with pytest.raises(RequestTooLargeError):  # the same key with more rows: over the element limit
            await batcher.infer({"x": x})
        with pytest.raises(InputError, match="float32"):  # another dtype: another key, checked in full
            await batcher.infer({"x": x[:2].astype(np.float64)})
        with pytest.raises(InputError, match="shape"):  # another non-batch dim: checked in full
            await batcher.infer({"x": np.zeros((2, 3), np.float32)})
        np.testing.assert_array_equal((await batcher.infer({"x": x[:3]}))["y"], np.maximum(x[:3], 0))


# -- the ASGI fast path ----------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_the_fast_path_answers_as_the_routes_did(digits_model, digits_samples):
    app = create_app({"digits": digits_model})
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            body, length = binary_body(digits_samples[0][:2])
            headers = {"Inference-Header-Content-Length": length, "Content-Type": "application/octet-stream"}
            for path in ("/v2/models/digits/infer", "/v2/models/digits/versions/1/infer"):
                answer = await client.post(path, content=body, headers=headers)
                assert answer.status_code == 200 and answer.headers["content-type"] == "application/octet-stream"
                assert int(answer.headers["content-length"]) == len(answer.content)
            assert (await client.get("/v2/models/digits/infer")).status_code == 405  # to Starlette's router
            assert (await client.post("/v2/models//infer", content=body)).status_code == 404
            missing = await client.post("/v2/models/nope/infer", content=body, headers=headers)
            assert missing.status_code == 404 and "unknown model 'nope'" in missing.json()["error"]
            bad = await client.post("/v2/models/digits/infer", content=b"{")
            assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]
