"""Scale-out on Ray Serve: a local 2-replica application, called by Triton's own HTTP client.

One Ray session for the module (2 CPUs, a small object store, no dashboard) and one application:
a Triton-layout model repository in explicit model control, served by two replicas behind Ray
Serve's HTTP proxy, with asyncinfer's proxy middleware installed. The tests check that clients see
the protocol of ``asyncinfer serve`` (the metadata/config and shared-memory tests of
test_triton_http run here unchanged), that a load or unload reaches every replica (each replica
is asked for its own index), that counters reach Ray's metrics per replica, and that killing a
replica under load loses no request silently.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import asyncinfer as ai
from asyncinfer import assets
from conftest import free_port, make_model, tensor_info

ray = pytest.importorskip("ray", reason="Ray Serve comes with the 'ray' extra: pip install 'asyncinfer[ray]'")
serve = pytest.importorskip("ray.serve", reason="Ray Serve comes with the 'ray' extra: pip install 'asyncinfer[ray]'")
triton = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is a dev dependency")
triton_aio = pytest.importorskip("tritonclient.http.aio", reason="tritonclient[http] is a dev dependency")

from asyncinfer.serving.ray import app_builder, deployment, proxy  # noqa: E402
from asyncinfer.serving.ray.control import ModelControl  # noqa: E402

# The same client tests as the single-process server, collected here with this module's `client`.
from .test_triton_http import (  # noqa: E402,F401
    test_health_metadata_and_config,
    write_repository,
    test_shared_memory_calls_fail_clearly,
)

APP = "asyncinfer-test"
REPLICAS = 2
SLOW_ROWS, SLOW_WIDTH, SLOW_LAYERS = 512, 256, 8  # ~0.5 GFLOP: tens of ms per request on one thread
RTOL, ATOL = 1e-5, 1e-5


def slow_model(seed: int = 0) -> onnx.ModelProto:
    """``y = tanh(...tanh(x W0) W1 ...)``: x [N, 256], a chain of 256x256 MatMul/Tanh layers."""
    rng = np.random.default_rng(seed)
    nodes, weights, last = [], [], "x"
    for i in range(SLOW_LAYERS):
        weights.append(numpy_helper.from_array((rng.standard_normal((SLOW_WIDTH, SLOW_WIDTH)) / 16).astype(np.float32),
                                               f"w{i}"))
        nodes += [helper.make_node("MatMul", [last, f"w{i}"], [f"m{i}"]),
                  helper.make_node("Tanh", [f"m{i}"], [f"t{i}" if i < SLOW_LAYERS - 1 else "y"])]
        last = f"t{i}"
    return make_model(nodes, [tensor_info("x", ["N", SLOW_WIDTH])], [tensor_info("y", ["N", SLOW_WIDTH])], weights,
                      extra_domains=())



@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    """digits (versions 1 and 2, as in test_triton_http), scale (not loaded at startup), slow."""
    root = write_repository(tmp_path_factory.mktemp("ray-repository"))
    (root / "slow" / "1").mkdir(parents=True)
    onnx.save(slow_model(), str(root / "slow" / "1" / "model.onnx"))
    return root


@pytest.fixture(scope="module")
def app(repository: Path) -> Iterator[dict]:
    """The application, running: ``{"port": proxy port, "handle": handle to the replicas}``."""
    saved = os.environ.get(proxy.ENV_VAR)
    os.environ[proxy.ENV_VAR] = proxy.IMPORT_PATH  # the local cluster's proxy inherits it
    try:
        for attempt in range(3):  # a local cluster's start can lose a port race to another process
            port = free_port()
            try:
                ray.init(num_cpus=2, object_store_memory=80 << 20, include_dashboard=False, log_to_driver=False,
                         _system_config={"metrics_report_interval_ms": 1000})
                serve.start(http_options={"host": "127.0.0.1", "port": port})
                handle = serve.run(deployment(repository=repository, model_control_mode="explicit",
                                              load_models=["digits", "slow"], replicas=REPLICAS, threads=1,
                                              cpus_per_replica=0.5, metrics_interval=0.5),
                                   name=APP, route_prefix="/")
                break
            except Exception:  # noqa: BLE001 - the last attempt's error is the test's
                ray.shutdown()
                if attempt == 2:
                    raise
        yield {"port": port, "handle": handle}
    finally:
        ray.shutdown()  # the local cluster goes with it (its Serve apps too): faster than serve.shutdown()
        if saved is None:
            os.environ.pop(proxy.ENV_VAR, None)
        else:
            os.environ[proxy.ENV_VAR] = saved


@pytest.fixture
def client(app) -> Iterator:
    client = triton.InferenceServerClient(f"127.0.0.1:{app['port']}", connection_timeout=30, network_timeout=30)
    try:
        yield client
    finally:
        client.close()


def reach_replicas(handle, count: int = REPLICAS, calls: int = 200) -> dict[int, dict]:
    """``{pid: replica_info}`` of up to ``count`` replicas (the handle picks a replica per call)."""
    seen: dict[int, dict] = {}
    for _ in range(calls):
        info = handle.replica_info.remote().result(timeout_s=30)
        seen[info["pid"]] = info
        if len(seen) == count:
            break
    return seen


def every_replica(handle, count: int = REPLICAS) -> dict[int, dict]:
    seen = reach_replicas(handle, count)
    assert len(seen) == count, f"reached {len(seen)} of {count} replicas"
    return seen


def states(info: dict) -> dict[str, tuple[str, str]]:
    """``{model: (state, reason)}`` of a replica's index (the latest version of each model)."""
    return {entry["name"]: (entry["state"], entry["reason"]) for entry in info["models"]}


async def infer_concurrently(port: int, images: np.ndarray, requests: int) -> list:
    """``requests`` digits requests in flight at once, through Triton's asyncio client.

    Its gevent twin (``async_infer``) is not used here: about one run in twenty, one of its greenlets
    kept the connection pool's only slot and the rest waited forever (gevent's LoopExit).
    """
    client = triton_aio.InferenceServerClient(f"127.0.0.1:{port}", conn_timeout=30)
    try:
        tensor = triton_aio.InferInput("image", list(images.shape), "FP32")
        tensor.set_data_from_numpy(images)
        return await asyncio.gather(*(client.infer("digits", [tensor], model_version="2") for _ in range(requests)))
    finally:
        await client.close()


def test_infer_json_binary_and_errors_through_the_proxy(client, app, digits_samples):
    images = digits_samples[0][:3]
    expected = ReferenceEvaluator(str(assets.default_model_path())).run(None, {"image": images})
    for binary in (True, False):
        tensor = triton.InferInput("image", list(images.shape), "FP32")
        tensor.set_data_from_numpy(images, binary_data=binary)
        wanted = [triton.InferRequestedOutput(n, binary_data=binary) for n in ("logits", "probabilities")]
        result = client.infer("digits", [tensor], outputs=wanted, request_id=f"r{binary}")
        assert result.get_response()["id"] == f"r{binary}" and result.get_response()["model_version"] == "2"
        np.testing.assert_allclose(result.as_numpy("logits"), expected[0], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(result.as_numpy("probabilities"), expected[1], rtol=RTOL, atol=ATOL)
    concurrent = asyncio.run(infer_concurrently(app["port"], images, requests=24))
    for result in concurrent:
        np.testing.assert_allclose(result.as_numpy("probabilities"), expected[1], rtol=RTOL, atol=ATOL)
    bad = triton.InferInput("image", [1, 1, 8, 7], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 1, 8, 7), np.float32))
    with pytest.raises(triton.InferenceServerException, match="must have shape") as failed:
        client.infer("digits", [bad])
    assert failed.value.status() == "400"
    # both replicas answered: each one's own statistics count its share
    served = {pid: sum(s["inference_stats"]["success"]["count"] for s in info["statistics"]["model_stats"]
                       if s["name"] == "digits")
              for pid, info in every_replica(app["handle"]).items()}
    assert all(count > 0 for count in served.values()), served
    assert sum(served.values()) >= 2 + len(concurrent)


def test_load_and_unload_reach_every_replica(client, app):
    handle = app["handle"]
    assert all(states(info)["scale"] == ("UNAVAILABLE", "not loaded") for info in every_replica(handle).values())
    client.load_model("scale")  # answered once every replica has loaded it
    assert all(states(info)["scale"] == ("READY", "") for info in every_replica(handle).values())
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    tensor = triton.InferInput("x", [2, 3], "FP32")
    tensor.set_data_from_numpy(x)
    for _ in range(8):  # whichever replica answers
        np.testing.assert_array_equal(client.infer("scale", [tensor]).as_numpy("y"), 3 * x)
    client.unload_model("scale")
    assert all(states(info)["scale"] == ("UNAVAILABLE", "unloaded") for info in every_replica(handle).values())
    with pytest.raises(triton.InferenceServerException, match="not ready"):
        client.infer("scale", [tensor])
    # a reload with a config of Triton's JSON form: every replica serves the new config
    client.load_model("scale", config=json.dumps({"max_batch_size": 4, "dynamic_batching": {}}))
    assert {client.get_model_config("scale")["max_batch_size"] for _ in range(8)} == {4}
    assert all(states(info)["scale"] == ("READY", "") for info in every_replica(handle).values())
    with pytest.raises(triton.InferenceServerException, match="no model 'ghost'"):
        client.load_model("ghost")  # refused by the replica that took it: nothing is fanned out


def test_counters_reach_ray_metrics_per_replica(client, app):
    """Each replica's counters are in Ray's metrics, tagged with the replica; /metrics answers too."""
    x = np.ones((1, SLOW_WIDTH), np.float32)
    tensor = triton.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    for _ in range(16):
        client.infer("slow", [tensor])
    with urllib.request.urlopen(f"http://127.0.0.1:{app['port']}/metrics", timeout=30) as answer:
        assert 'nv_inference_request_success{model="slow",version="1"}' in answer.read().decode()
    address = f"http://127.0.0.1:{ray.nodes()[0]['MetricsExportPort']}/metrics"  # the one node's
    total = 0.0
    for _ in range(120):  # Ray exports every second here (metrics_report_interval_ms)
        with urllib.request.urlopen(address, timeout=30) as answer:
            samples = [line for line in answer.read().decode().splitlines()
                       if line.startswith("ray_asyncinfer_request_success") and 'model="slow"' in line]
        total = sum(float(line.rsplit(" ", 1)[1]) for line in samples)
        if total >= 16:
            break
        threading.Event().wait(0.5)
    assert total >= 16, samples
    assert all(f'application="{APP}"' in line and 'replica="' in line for line in samples)


def test_a_killed_replica_loses_no_request(app):
    """SIGKILL one replica while it holds requests: every request is answered (by a retry on the
    other replica, or a clear JSON error), none hangs, and Ray Serve starts a replacement that
    catches up with the models loaded through the API."""
    handle, port = app["handle"], app["port"]
    before = every_replica(handle)
    x = np.random.default_rng(1).standard_normal((SLOW_ROWS, SLOW_WIDTH)).astype(np.float32)
    expected = ReferenceEvaluator(slow_model()).run(None, {"x": x})[0]
    header = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                     "parameters": {"binary_data_size": x.nbytes}}],
                         "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}).encode()
    body = header + x.tobytes()
    outcomes: list[tuple] = []
    lock = threading.Lock()

    def load(requests: int) -> None:
        for _ in range(requests):
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v2/models/slow/infer", data=body, method="POST",
                headers={"Content-Type": "application/octet-stream",
                         "Inference-Header-Content-Length": str(len(header))})
            try:
                with urllib.request.urlopen(request, timeout=60) as answer:
                    size = int(answer.headers["Inference-Header-Content-Length"])
                    y = np.frombuffer(answer.read()[size:], np.float32).reshape(x.shape)
                    outcome = (200, bool(np.allclose(y, expected, rtol=1e-4, atol=1e-5)),
                               answer.headers.get(proxy.RETRIED_HEADER))
            except urllib.error.HTTPError as exc:  # a clear error is JSON with an "error" message
                text = exc.read().decode(errors="replace")
                try:
                    clear = bool(json.loads(text).get("error"))
                except ValueError:
                    clear = False
                outcome = (exc.code, clear, text[:200])
            except Exception as exc:  # noqa: BLE001 - a timeout or a dropped connection: counted as lost
                outcome = ("lost", False, repr(exc)[:200])
            with lock:
                outcomes.append(outcome)

    clients, each = 6, 8
    threads = [threading.Thread(target=load, args=(each,), daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    # kill a replica seen holding requests of the slow model
    victim = None
    for _ in range(400):
        info = handle.replica_info.remote().result(timeout_s=30)
        if info["in_flight"].get("slow", 0) > 0:
            victim = info["pid"]
            break
    assert victim is not None, "no replica was seen holding a request"
    os.kill(victim, signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a request hung"
    assert len(outcomes) == clients * each  # every request got an outcome
    summary = Counter((status, ok) for status, ok, _ in outcomes)
    lost = [o for o in outcomes if not o[1]]
    assert not lost, (summary, lost[:3])  # 200 with the right answer, or a clear JSON error
    # the requests the victim held were sent again to the other replica
    assert any(status == 200 and retried for status, _, retried in outcomes), summary

    # Ray Serve replaces the replica; the new one loads what the API loaded through the other
    after: dict[int, dict] = {}
    for _ in range(240):
        after = reach_replicas(handle, calls=20)
        if len(after) == REPLICAS and victim not in after:
            break
        threading.Event().wait(0.5)
    assert victim not in after and len(after) == REPLICAS and set(before) - {victim} <= set(after)
    assert len({frozenset(states(info).items()) for info in after.values()}) == 1, after


def test_model_control_takes_back_the_state_of_a_replica_after_a_restart():
    """A restarted ModelControl (its state was in memory) adopts the state a replica applied, and
    a replica's report of what it applied is what a fan-out waits for."""
    import asyncio

    async def scenario() -> None:
        control = ModelControl()
        token = await control.publish("r1", "scale", "load", None)
        epoch, desired = await control.sync("r2", "", {}, wait=0)  # r2 is behind: answered at once
        assert desired["scale"]["token"] == token
        outcome = await control.wait_applied("scale", token, timeout=0.2)
        assert outcome["missing"] == ["r2"] and outcome["replicas"] == 2
        applied = {"scale": {**desired["scale"], "error": "ModelLoadError: no file"}}
        await control.sync("r2", epoch, applied, wait=0)
        outcome = await control.wait_applied("scale", token, timeout=5)
        assert outcome == {"replicas": 2, "failed": {"r2": "ModelLoadError: no file"}, "missing": []}

        restarted = ModelControl()  # a new epoch, and nothing desired
        epoch2, desired2 = await restarted.sync("r1", epoch, applied, wait=0)
        assert epoch2 != epoch and desired2["scale"]["token"] == token
        _, desired3 = await restarted.sync("r3", "", {}, wait=0)  # a new replica learns it
        assert desired3 == desired2

    asyncio.run(scenario())


def test_the_proxy_middleware_answers_a_lost_request_clearly():
    """Without a live replica to retry on, the proxy's silent return becomes a 503 JSON error;
    a request whose first try was lost is sent again with its body."""
    import asyncio

    async def scenario() -> None:
        bodies: list[bytes] = []

        async def proxy_losing(times: int):
            calls = 0

            async def app(scope, receive, send):
                nonlocal calls
                calls += 1
                message = await receive()
                bodies.append(message.get("body", b""))
                if calls > times:
                    await send({"type": "http.response.start", "status": 200, "headers": []})
                    await send({"type": "http.response.body", "body": b"ok"})
            return app

        async def call(middleware, path="/v2/models/m/infer", body=b"{}"):
            sent: list[dict] = []
            messages = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive():
                return messages.pop(0) if messages else {"type": "http.disconnect"}

            async def send(message):
                sent.append(message)

            scope = {"type": "http", "method": "POST", "path": path,
                     "headers": [(b"content-length", str(len(body)).encode())]}
            await middleware(scope, receive, send)
            return sent

        answered = await call(proxy.LostReplicaRetry(await proxy_losing(1)), body=b'{"inputs": []}')
        assert answered[0]["status"] == 200 and (proxy.RETRIED_HEADER.encode(), b"1") in answered[0]["headers"]
        assert bodies == [b'{"inputs": []}'] * 2  # the retry carried the same body
        refused = await call(proxy.LostReplicaRetry(await proxy_losing(5)))
        assert refused[0]["status"] == 503 and (b"retry-after", b"1") in refused[0]["headers"]
        assert "replica serving this request stopped" in json.loads(refused[1]["body"])["error"]
        bodies.clear()  # a load is not sent twice (it is not an inference)
        refused = await call(proxy.LostReplicaRetry(await proxy_losing(5)), path="/v2/repository/models/m/load")
        assert refused[0]["status"] == 503 and len(bodies) == 1

    asyncio.run(scenario())


def test_deployment_checks_its_arguments_before_anything_starts(tmp_path):
    built = app_builder({"models": {"m": str(assets.default_model_path())}, "autoscale": [1, 2]})
    assert isinstance(built, serve.Application)
    with pytest.raises(ValueError, match="models or a repository"):
        deployment()
    with pytest.raises(ai.ModelLoadError, match="no such file"):
        deployment({"m": tmp_path / "missing.onnx"})
    with pytest.raises(ValueError, match="unknown option"):
        deployment({"m": assets.default_model_path()}, max_batch=3)
    with pytest.raises(ValueError, match="autoscale"):
        deployment({"m": assets.default_model_path()}, autoscale=(3, 1))
    with pytest.raises(ValueError, match="a path or ONNX bytes"):
        deployment({"m": ai.load_model(assets.default_model_path())})


def _parse(*argv: str):
    import argparse

    from asyncinfer.serving.cli import add_serve_command

    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_serve_ray_maps_the_command_line_to_a_deployment(monkeypatch, repository):
    from asyncinfer.serving import cli as serve_cli
    from asyncinfer.serving import ray as serving_ray

    seen: dict = {}
    monkeypatch.setattr(serving_ray, "deployment", lambda *args, **kwargs: seen.update(args=args, kwargs=kwargs))
    monkeypatch.setattr(serving_ray, "serve_forever", lambda app, host, port: seen.update(at=(host, port)) or 0)
    args = _parse("--ray", "--autoscale", "1:4", "--gpus-per-replica", "0.5", "--threads", "1", "--port", "9100",
                  "--model-repository", str(repository), "--model-control-mode", "explicit", "--load-model", "*")
    assert serve_cli.run_serve(args) == 0
    options = seen["kwargs"]
    assert seen["at"] == ("127.0.0.1", 9100) and options["repository"] == repository
    assert (options["autoscale"], options["gpus_per_replica"], options["threads"]) == ((1, 4), 0.5, 1)
    assert (options["model_control_mode"], options["load_models"]) == ("explicit", ["*"])
    assert "cpus_per_replica" not in options  # the deployment's default
    seen.clear()
    assert serve_cli.run_serve(_parse("--ray", "--replicas", "3")) == 0
    assert seen["args"][0] == {"digits": assets.default_model_path()} and seen["kwargs"]["replicas"] == 3


@pytest.mark.parametrize("argv, message", [
    (["--replicas", "2"], "--replicas need(s) --ray"),
    (["--gpus-per-replica", "1", "--autoscale", "0:2"], "--autoscale, --gpus-per-replica need(s) --ray"),
    (["--ray", "--grpc-port", "9001"], "--grpc-port is not available with --ray"),
])
def test_serve_ray_option_errors(argv, message, capsys):
    from asyncinfer.serving.cli import run_serve

    assert run_serve(_parse(*argv)) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--ray", "--autoscale", "3:1"], ["--ray", "--autoscale", "2"],
                                  ["--ray", "--replicas", "0"], ["--ray", "--replicas", "2", "--autoscale", "1:2"]])
def test_serve_ray_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        _parse(*argv)
    assert exit_.value.code == 2 and "Traceback" not in capsys.readouterr().err
