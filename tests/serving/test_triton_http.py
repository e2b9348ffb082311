"""Triton's own HTTP client, unchanged, against a real ``asyncinfer serve`` (uvicorn on a free port).

Every call of ``tritonclient.http.InferenceServerClient`` a Triton user makes: health, metadata,
config, repository index, explicit load/unload, statistics, infer (JSON and binary tensors),
async_infer, and the shared-memory calls, which must fail with a clear message. The server
serves a Triton-layout model repository in explicit model control mode.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import asyncinfer as ai
from asyncinfer import assets
from asyncinfer.serving import create_app
from asyncinfer.serving.service import InferenceService
from conftest import make_model, tensor_info

triton = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is a dev dependency")
uvicorn = pytest.importorskip("uvicorn", reason="uvicorn comes with the serve extra")

from .uvicorn_thread import ServerThread  # noqa: E402 - after the skips

RTOL, ATOL = 1e-5, 1e-5


def scaled_model(factor: float) -> onnx.ModelProto:
    k = helper.make_tensor("k", TensorProto.FLOAT, [1], [factor])
    return make_model([helper.make_node("Mul", ["x", "k"], ["y"])], [tensor_info("x", ["N", 3])],
                      [tensor_info("y", ["N", 3])], [k], extra_domains=())


def write_repository(root: Path) -> Path:
    """A Triton model repository in ``root``: digits (versions 1 and 2, dynamic batching) and scale."""
    for version in (1, 2):
        (root / "digits" / str(version)).mkdir(parents=True)
        shutil.copyfile(assets.default_model_path(), root / "digits" / str(version) / "model.onnx")
    (root / "digits" / "config.pbtxt").write_text(
        'name: "digits"\nmax_batch_size: 16\ndynamic_batching { max_queue_delay_microseconds: 1000 }\n')
    (root / "scale" / "1").mkdir(parents=True)
    onnx.save(scaled_model(3.0), str(root / "scale" / "1" / "model.onnx"))
    return root


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    return write_repository(tmp_path)


@pytest.fixture
def client(repository: Path) -> Iterator:
    service = InferenceService.from_repository(repository, model_control_mode="explicit", load_models=["digits"])
    with ServerThread(create_app(service=service)) as server:
        client = triton.InferenceServerClient(f"127.0.0.1:{server.port}", connection_timeout=20, network_timeout=20)
        try:
            yield client
        finally:
            client.close()


def test_health_metadata_and_config(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("digits") and client.is_model_ready("digits", "2")
    assert not client.is_model_ready("scale")  # in the repository, not loaded
    meta = client.get_server_metadata()
    assert meta["name"] == "asyncinfer" and meta["version"] == ai.__version__
    assert {"binary_tensor_data", "model_repository", "model_configuration", "statistics"} <= set(meta["extensions"])
    model = client.get_model_metadata("digits")
    assert model["versions"] == ["2"] and model["platform"] == "onnx"  # the latest version only
    assert model["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    config = client.get_model_config("digits")
    assert config["name"] == "digits" and config["platform"] == "onnxruntime_onnx"
    assert config["max_batch_size"] == 16 and config["dynamic_batching"]["max_queue_delay_microseconds"] == 1000
    assert config["input"][0]["dims"] == [1, 8, 8] and config["input"][0]["data_type"] == "TYPE_FP32"
    assert [o["name"] for o in config["output"]] == ["logits", "probabilities"]
    assert config["instance_group"][0]["kind"] == "KIND_CPU"
    assert client.get_model_config("digits", "2") == config
    with pytest.raises(triton.InferenceServerException, match="has no version '1'"):
        client.get_model_config("digits", "1")
    with pytest.raises(triton.InferenceServerException, match="unknown model 'nope'"):
        client.get_model_metadata("nope")


def test_repository_load_and_unload(client):
    index = client.get_model_repository_index()
    assert [(e["name"], e.get("version"), e["state"]) for e in index] == [
        ("digits", "2", "READY"), ("scale", "", "UNAVAILABLE")]
    client.load_model("scale")
    assert client.is_model_ready("scale")
    x = np.ones((2, 3), np.float32)
    tensor = triton.InferInput("x", [2, 3], "FP32")
    tensor.set_data_from_numpy(x)
    np.testing.assert_allclose(client.infer("scale", [tensor]).as_numpy("y"), 3 * x)
    client.unload_model("scale")
    assert not client.is_model_ready("scale")
    entry = [e for e in client.get_model_repository_index() if e["name"] == "scale"][0]
    assert entry["state"] == "UNAVAILABLE" and entry["reason"] == "unloaded"
    # a reload with a config of Triton's JSON form
    client.load_model("scale", config=json.dumps({"max_batch_size": 4, "dynamic_batching": {}}))
    assert client.get_model_config("scale")["max_batch_size"] == 4
    with pytest.raises(triton.InferenceServerException, match="no model 'ghost'"):
        client.load_model("ghost")


def test_infer_json_binary_async_and_statistics(client, digits_samples):
    images = digits_samples[0][:3]
    with ai.Worker(ai.load_model(assets.default_model_path())) as worker:
        expected = worker.run_blocking(images)
    calls = 0
    for binary in (True, False):
        tensor = triton.InferInput("image", list(images.shape), "FP32")
        tensor.set_data_from_numpy(images, binary_data=binary)
        wanted = [triton.InferRequestedOutput(n, binary_data=binary) for n in ("logits", "probabilities")]
        result = client.infer("digits", [tensor], outputs=wanted, request_id=f"r{binary}")
        calls += 1
        assert result.get_response()["id"] == f"r{binary}" and result.get_response()["model_version"] == "2"
        for name in expected:
            np.testing.assert_allclose(result.as_numpy(name), expected[name], rtol=RTOL, atol=ATOL)
    tensor = triton.InferInput("image", list(images.shape), "FP32")
    tensor.set_data_from_numpy(images)
    pending = [client.async_infer("digits", [tensor], model_version="2") for _ in range(4)]
    for request in pending:
        np.testing.assert_allclose(request.get_result().as_numpy("probabilities"), expected["probabilities"],
                                   rtol=RTOL, atol=ATOL)
    calls += len(pending)
    bad = triton.InferInput("image", [1, 1, 8, 7], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 1, 8, 7), np.float32))
    with pytest.raises(triton.InferenceServerException, match="must have shape"):
        client.infer("digits", [bad])

    stats = client.get_inference_statistics("digits")["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("digits", "2")]
    inference = stats[0]["inference_stats"]
    assert inference["success"]["count"] == calls and inference["fail"]["count"] == 1
    assert stats[0]["inference_count"] == calls * len(images)
    assert 1 <= stats[0]["execution_count"] <= calls
    assert inference["compute_infer"]["count"] == calls and inference["queue"]["count"] == calls
    everything = client.get_inference_statistics()["model_stats"]
    assert ("digits", "2") in [(s["name"], s["version"]) for s in everything]
    assert client.get_inference_statistics("digits", "2")["model_stats"] == stats


def test_shared_memory_calls_fail_clearly(client):
    for call in (lambda: client.get_system_shared_memory_status(),
                 lambda: client.get_system_shared_memory_status("region"),
                 lambda: client.register_system_shared_memory("region", "/key", 64),
                 lambda: client.unregister_system_shared_memory(),
                 lambda: client.get_cuda_shared_memory_status(),
                 lambda: client.unregister_cuda_shared_memory("region")):
        with pytest.raises(triton.InferenceServerException, match="shared memory is not supported") as failed:
            call()
        assert failed.value.status() == "501"
    assert client.is_server_ready()  # and the server goes on
