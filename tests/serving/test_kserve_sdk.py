"""The KServe Python SDK's v2 clients (``InferenceRESTClient`` and ``InferenceGRPCClient``),
unchanged, against ``asyncinfer serve --grpc-port`` in a subprocess: health, readiness and
inference with JSON and binary tensors over REST, and over gRPC.

The SDK pulls in kubernetes, pandas and more, so it is not a dev dependency: install it
(``pip install kserve``) to run this file; without it the tests skip, saying so."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import numpy as np
import pytest

import asyncinfer as ai
from conftest import free_port
from asyncinfer import assets

kserve = pytest.importorskip("kserve", reason="the KServe SDK (pip install kserve) is not a dev dependency: heavy")



@pytest.fixture(scope="module")
def server():
    import httpx

    http, grpc = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "asyncinfer", "serve", "--port", str(http), "--grpc-port", str(grpc)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{http}/v2/health/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            pytest.fail("asyncinfer serve did not become ready")
        yield http, grpc
    finally:
        proc.terminate()
        proc.wait(20)


def _request(x: np.ndarray, binary: bool):
    item = kserve.InferInput("image", list(x.shape), "FP32")
    item.set_data_from_numpy(x, binary_data=binary)
    return kserve.InferRequest(model_name="digits", infer_inputs=[item])


def _expected(x: np.ndarray) -> np.ndarray:
    with ai.Worker(ai.load_model(assets.default_model_path())) as worker:
        return worker.run_blocking(x)["probabilities"]


def test_the_rest_client_checks_health_and_infers_json_and_binary(server):
    http, _ = server
    x = assets.default_samples()[0][:4]

    async def calls():
        client = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2", retries=1))
        base = f"http://127.0.0.1:{http}"
        try:
            assert await client.is_server_live(base) and await client.is_server_ready(base)
            assert await client.is_model_ready(base, "digits")
            return [await client.infer(base, _request(x, binary), model_name="digits") for binary in (False, True)]
        finally:
            await client.close()

    for response in asyncio.run(calls()):
        outputs = {o.name: o.as_numpy() for o in response.outputs}
        np.testing.assert_allclose(outputs["probabilities"], _expected(x), rtol=1e-5, atol=1e-6)


def test_the_grpc_client_checks_health_and_infers(server):
    _, grpc = server
    x = assets.default_samples()[0][:4]

    async def calls():
        client = kserve.InferenceGRPCClient(f"127.0.0.1:{grpc}")
        try:
            assert await client.is_server_live() and await client.is_server_ready()
            assert await client.is_model_ready("digits")
            return await client.infer(_request(x, False))
        finally:
            await client.close()

    outputs = {o.name: o.as_numpy() for o in asyncio.run(calls()).outputs}
    np.testing.assert_allclose(outputs["probabilities"], _expected(x), rtol=1e-5, atol=1e-6)
