"""The model repository: Triton's layout, config.pbtxt, versions, model control modes, failures.

Models are written into a temporary repository; the service is driven directly (its contract is
what the HTTP and gRPC adapters call) and, where the answer's wire form matters, over HTTP
through httpx's ASGI transport. Poll mode is driven with ``poll_once()`` so nothing races a timer.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from asyncinfer import assets
from asyncinfer.serving import create_app
from asyncinfer.serving.protocol import ProtocolError
from asyncinfer.serving.repository import ModelSettings, config_from_json, read_config_file, triton_config
from asyncinfer.serving.service import InferenceService
from conftest import TEST_DOMAIN, make_model, tensor_info

HANG = 20  # seconds: a bound against hangs, never a timing assertion


def add_version(repository: Path, name: str, version: int, source: Path | onnx.ModelProto | bytes) -> Path:
    """Write ``repository/name/version/model.onnx``."""
    path = repository / name / str(version) / "model.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(source, Path):
        shutil.copyfile(source, path)
    elif isinstance(source, bytes):
        path.write_bytes(source)
    else:
        onnx.save(source, str(path))
    return path


def fixed_model() -> onnx.ModelProto:
    """y = x + 1 on a fixed [2, 3]: no batch dimension."""
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    return make_model([helper.make_node("Add", ["x", "one"], ["y"])], [tensor_info("x", [2, 3])],
                      [tensor_info("y", [2, 3])], [one], extra_domains=())


def scaled_model(factor: float) -> onnx.ModelProto:
    """y = x * factor on [N, 3]: versions that answer differently."""
    k = helper.make_tensor("k", TensorProto.FLOAT, [1], [factor])
    return make_model([helper.make_node("Mul", ["x", "k"], ["y"])], [tensor_info("x", ["N", 3])],
                      [tensor_info("y", ["N", 3])], [k], extra_domains=())


@asynccontextmanager
async def running(repository: Path, **options) -> AsyncIterator[InferenceService]:
    service = InferenceService.from_repository(repository, **options)
    async with service:
        yield service


async def infer(service: InferenceService, name: str, x: np.ndarray, version: str | None = None) -> dict:
    async with service.request(name, version) as call:
        outputs = await call.infer({"x": x})
    return {"version": call.version, **outputs}


X = np.arange(6, dtype=np.float32).reshape(2, 3)


# -- layout and versions ---------------------------------------------------------------------------
@pytest.mark.anyio
async def test_the_highest_version_is_served_by_default(tmp_path):
    for version, factor in [(1, 1.0), (2, 2.0), (10, 10.0)]:  # 10 > 2: versions are numbers
        add_version(tmp_path, "scale", version, scaled_model(factor))
    (tmp_path / "scale" / "notes").mkdir()  # not a version: ignored
    async with running(tmp_path) as service:
        assert service.ready()
        got = await infer(service, "scale", X)
        assert got["version"] == "10"
        np.testing.assert_allclose(got["y"], X * 10)
        assert service.repository_index() == [{"name": "scale", "version": "10", "state": "READY", "reason": ""}]
        assert service.model_metadata("scale")["versions"] == ["10"]
        with pytest.raises(ProtocolError) as refused:
            await infer(service, "scale", X, version="1")
        assert refused.value.status == 404 and "has no version '1'; available: ['10']" in refused.value.message


@pytest.mark.anyio
async def test_version_policy_all_and_specific(tmp_path):
    for version, factor in [(1, 1.0), (2, 2.0), (3, 3.0)]:
        add_version(tmp_path, "every", version, scaled_model(factor))
        add_version(tmp_path, "some", version, scaled_model(factor))
    (tmp_path / "every" / "config.pbtxt").write_text("version_policy: { all { } }\n")
    (tmp_path / "some" / "config.pbtxt").write_text("version_policy: { specific { versions: [1, 3] } }\n")
    async with running(tmp_path) as service:
        for version in ("1", "2", "3"):
            got = await infer(service, "every", X, version)
            np.testing.assert_allclose(got["y"], X * int(version))
        assert (await infer(service, "every", X))["version"] == "3"  # no version: the latest
        assert [e["version"] for e in service.repository_index() if e["name"] == "some"] == ["1", "3"]
        assert service.model_config("some")["version_policy"] == {"specific": {"versions": [1, 3]}}
        stats = service.statistics("every")["model_stats"]
        assert [(s["version"], s["inference_stats"]["success"]["count"]) for s in stats] == [
            ("1", 1), ("2", 1), ("3", 2)]


@pytest.mark.anyio
async def test_config_pbtxt_sets_batching_instances_and_backend(tmp_path):
    add_version(tmp_path, "digits", 1, assets.default_model_path())
    (tmp_path / "digits" / "config.pbtxt").write_text('''
        # a config as Triton users write them
        name: "digits"
        platform: "onnxruntime_onnx"
        max_batch_size: 8
        input [ { name: "image", data_type: TYPE_FP32, dims: [ 1, 8, 8 ] } ]
        output [ { name: "probabilities" data_type: TYPE_FP32 dims: [ 10 ] } ]
        dynamic_batching { max_queue_delay_microseconds: 1500 preferred_batch_size: [ 4, 8 ] }
        instance_group [ { count: 3 kind: KIND_CPU } ]
        parameters { key: "threads" value: { string_value: "2" } }
        optimization { execution_accelerators { } }   # not used: logged and ignored
    ''')
    async with running(tmp_path, backend="cpu") as service:
        served = service.models["digits"]
        assert served.batcher is not None and served.batcher.max_batch_size == 8
        assert served.batcher.max_delay == pytest.approx(0.0015) and served.batcher.max_concurrent_batches == 3
        assert served.settings.threads == 2
        config = service.model_config("digits")
        assert config["max_batch_size"] == 8 and config["dynamic_batching"]["max_queue_delay_microseconds"] == 1500
        assert config["instance_group"][0]["count"] == 3 and config["instance_group"][0]["kind"] == "KIND_CPU"
        assert config["input"] == [{"name": "image", "data_type": "TYPE_FP32", "format": "FORMAT_NONE",
                                    "dims": [1, 8, 8], "is_shape_tensor": False, "allow_ragged_batch": False,
                                    "optional": False}]
        assert config["parameters"] == {"threads": {"string_value": "2"}}


@pytest.mark.anyio
async def test_max_batch_size_zero_turns_batching_off_and_keeps_the_full_dims(tmp_path):
    add_version(tmp_path, "digits", 1, assets.default_model_path())
    (tmp_path / "digits" / "config.pbtxt").write_text("max_batch_size: 0\n")
    add_version(tmp_path, "fixed", 1, fixed_model())  # no config, but no batch dimension either
    async with running(tmp_path) as service:
        assert service.models["digits"].batcher is None
        config = service.model_config("digits")
        assert config["max_batch_size"] == 0 and "dynamic_batching" not in config
        assert config["input"][0]["dims"] == [-1, 1, 8, 8]
        fixed = service.model_config("fixed")
        assert fixed["max_batch_size"] == 0 and fixed["input"][0]["dims"] == [2, 3]


# -- failures: the server starts, the index says why -------------------------------------------------
BAD_CONFIGS = [
    ('max_batch_size: "eight"\n', "config.pbtxt, line 1: 'max_batch_size' must be an integer, got 'eight'"),
    ("max_batch_size: 4\nmax_batch_size: 8\n", "config.pbtxt, line 2: field 'max_batch_size' is given 2 times"),
    ('name: "other"\n', "the config names the model 'other', but its directory is 'model'"),
    ("dynamic_batching {\n  max_queue_delay_microseconds: 5\n", "config.pbtxt, line 2: unexpected end of file"),
    ('name: "model\n', "config.pbtxt, line 1: unexpected character '\"'"),
    ("max_batch_size 8\n", "config.pbtxt, line 1: field 'max_batch_size': ':' expected before a value"),
    ("instance_group [ { kind: KIND_TPU } ]\n", "config.pbtxt, line 1: 'kind' must be one of KIND_AUTO"),
    ('platform: "tensorflow_savedmodel"\n', "asyncinfer serves ONNX models: platform 'tensorflow_savedmodel'"),
    ("sequence_batching { }\n", "'sequence_batching': asyncinfer does not serve stateful sequence batching"),
    ("version_policy: { latest { num_versions: 0 } }\n", "'num_versions' must be at least 1, got 0"),
    ('parameters { key: "backend" value: { string_value: "tpu" } }\n',
     "parameter 'backend' must be one of cpu, gpu_compute, gpu_pixel, got 'tpu'"),
    ('input [ { name: "pixels" data_type: TYPE_FP32 } ]\n',
     "input 'pixels' is not an input of model 'model' version 1"),
    ('input [ { name: "x" data_type: TYPE_INT64 } ]\n', "input 'x' is TYPE_FP32 in model 'model' version 1, the config "
                                                         "says TYPE_INT64"),
    ('input [ { name: "x" dims: [ 4 ] } ]\n', "input 'x' has dims [3] in model 'model' version 1 (without the batch "
                                              "dimension), the config says [4]"),
]


@pytest.mark.anyio
@pytest.mark.parametrize("text, message", BAD_CONFIGS, ids=[m[:40] for _, m in BAD_CONFIGS])
async def test_a_bad_config_leaves_the_model_unavailable_with_the_reason(tmp_path, text, message):
    add_version(tmp_path, "model", 1, scaled_model(2.0))
    (tmp_path / "model" / "config.pbtxt").write_text(text)
    add_version(tmp_path, "good", 1, scaled_model(3.0))
    async with running(tmp_path) as service:  # starts anyway
        entries = [e for e in service.repository_index() if e["name"] == "model"]
        assert len(entries) == 1 and entries[0]["state"] == "UNAVAILABLE", entries
        assert message in entries[0]["reason"], entries[0]["reason"]
        assert not service.ready()  # strict readiness: a model asked for is unavailable
        np.testing.assert_allclose((await infer(service, "good", X))["y"], X * 3)  # the others serve
        with pytest.raises(ProtocolError) as refused:
            await infer(service, "model", X)
        assert refused.value.status == 503 and message in refused.value.message


@pytest.mark.anyio
async def test_a_broken_model_file_is_listed_unavailable_and_the_server_still_serves(tmp_path):
    add_version(tmp_path, "broken", 1, b"this is not ONNX")
    add_version(tmp_path, "nobatch", 1, fixed_model())
    (tmp_path / "nobatch" / "config.pbtxt").write_text("max_batch_size: 4\n")
    (tmp_path / "empty").mkdir()  # no version at all
    add_version(tmp_path, "good", 1, scaled_model(3.0))
    async with running(tmp_path, strict_readiness=False) as service:
        index = {(e["name"], e["version"]): e for e in service.repository_index()}
        assert index[("broken", "1")]["state"] == "UNAVAILABLE"
        assert "ModelLoadError" in index[("broken", "1")]["reason"]
        assert str(tmp_path) not in index[("broken", "1")]["reason"]  # the server's paths stay private
        assert "max_batch_size 4 needs a batch dimension" in index[("nobatch", "1")]["reason"]
        assert "has no version directory" in index[("empty", "")]["reason"]
        assert index[("good", "1")]["state"] == "READY"
        assert service.ready()  # not strict: ready although some models are not
        assert service.repository_index(ready_only=True) == [index[("good", "1")]]
        with pytest.raises(ProtocolError) as refused:
            service.model_config("broken")
        assert refused.value.status == 404


# -- model control -------------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_explicit_mode_loads_and_unloads_on_request(tmp_path):
    add_version(tmp_path, "first", 1, scaled_model(1.0))
    add_version(tmp_path, "second", 1, scaled_model(2.0))
    async with running(tmp_path, model_control_mode="explicit", load_models=["first"]) as service:
        assert service.ready()  # only what was asked for counts
        index = {e["name"]: e for e in service.repository_index()}
        assert index["first"]["state"] == "READY"
        assert index["second"] == {"name": "second", "version": "", "state": "UNAVAILABLE", "reason": "not loaded"}
        await service.load("second")
        np.testing.assert_allclose((await infer(service, "second", X))["y"], X * 2)
        await service.unload("first")
        assert {e["name"]: e for e in service.repository_index()}["first"] == {
            "name": "first", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
        assert not service.model_ready("first") and service.ready()
        with pytest.raises(ProtocolError) as refused:
            await infer(service, "first", X)
        assert refused.value.status == 503
        # a load with a config in Triton's JSON form, replacing config.pbtxt
        await service.load("first", {"max_batch_size": 4, "dynamic_batching": {"max_queue_delay_microseconds": 0}})
        assert service.model_config("first")["max_batch_size"] == 4
        np.testing.assert_allclose((await infer(service, "first", X))["y"], X)
        for call, status, fragment in [(service.load("nope"), 404, "the model repository has no model 'nope'"),
                                       (service.load("../first"), 404, "no model '../first'"),
                                       (service.unload("nope"), 404, "unknown model 'nope'"),
                                       (service.load("first", {"max_batch_size": -1}), 400,
                                        "'max_batch_size' must be at least 0")]:
            with pytest.raises(ProtocolError) as refused:
                await call
            assert refused.value.status == status and fragment in refused.value.message


@pytest.mark.anyio
async def test_load_and_unload_are_refused_outside_explicit_mode(tmp_path, digits_model):
    add_version(tmp_path, "first", 1, scaled_model(1.0))
    async with running(tmp_path, model_control_mode="none") as service:
        for call in (service.load("first"), service.unload("first")):
            with pytest.raises(ProtocolError) as refused:
                await call
            assert refused.value.status == 400 and "--model-control-mode explicit" in refused.value.message
    async with InferenceService({"digits": digits_model}) as service:
        with pytest.raises(ProtocolError, match="serves a fixed set of models"):
            await service.load("digits")


@pytest.mark.anyio
async def test_a_failed_reload_keeps_the_loaded_version_serving(tmp_path):
    add_version(tmp_path, "model", 1, scaled_model(1.0))
    async with running(tmp_path, model_control_mode="explicit", load_models=["*"]) as service:
        add_version(tmp_path, "model", 2, b"not onnx either")
        with pytest.raises(ProtocolError) as refused:
            await service.load("model")
        assert refused.value.status == 400 and "version 2" in refused.value.message
        assert "the versions loaded before keep serving" in refused.value.message
        got = await infer(service, "model", X)
        assert got["version"] == "1"
        np.testing.assert_allclose(got["y"], X)


@pytest.mark.anyio
async def test_poll_mode_follows_the_repository(tmp_path):
    add_version(tmp_path, "model", 1, scaled_model(1.0))
    async with running(tmp_path, model_control_mode="poll", repository_poll_secs=3600) as service:
        assert (await infer(service, "model", X))["version"] == "1"
        add_version(tmp_path, "model", 2, scaled_model(2.0))  # a new version
        add_version(tmp_path, "added", 1, scaled_model(5.0))  # a new model
        await service.poll_once()
        got = await infer(service, "model", X)
        assert got["version"] == "2"
        np.testing.assert_allclose(got["y"], X * 2)
        np.testing.assert_allclose((await infer(service, "added", X))["y"], X * 5)
        shutil.rmtree(tmp_path / "added")  # a removed model is unloaded
        await service.poll_once()
        assert {e["name"]: e["state"] for e in service.repository_index()}["added"] == "UNAVAILABLE"
        assert [e["version"] for e in service.repository_index() if e["name"] == "model"] == ["2"]
        await service.poll_once()  # nothing changed: nothing reloaded
        assert service.models["model"].version == "2"


@pytest.mark.anyio
async def test_an_unload_lets_the_request_in_flight_finish(tmp_path, gate):
    name, opened = gate
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    nodes = [helper.make_node("Gate", ["x"], ["g"], domain=TEST_DOMAIN, gate=name),
             helper.make_node("Add", ["g", "one"], ["y"])]
    add_version(tmp_path, "slow", 1, make_model(nodes, [tensor_info("x", [2, 3])], [tensor_info("y", [2, 3])], [one]))
    async with running(tmp_path, model_control_mode="explicit", load_models=["slow"]) as service:
        answers: list = []

        async def call() -> None:
            answers.append(await infer(service, "slow", X))

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                with anyio.fail_after(HANG):
                    while service.models["slow"].in_flight != 1:
                        await anyio.sleep(0.002)
                tg.start_soon(service.unload, "slow")
                with anyio.fail_after(HANG):
                    while service.models["slow"].state.value != "UNLOADING":
                        await anyio.sleep(0.002)
                with pytest.raises(ProtocolError) as refused:  # no new requests meanwhile
                    await infer(service, "slow", X)
                assert refused.value.status == 503
                opened.set()
        finally:
            opened.set()
        np.testing.assert_allclose(answers[0]["y"], X + 1)
        assert service.repository_index()[0]["reason"] == "unloaded"


# -- the HTTP surface of the repository --------------------------------------------------------------
@pytest.mark.anyio
async def test_repository_endpoints_over_http(tmp_path):
    add_version(tmp_path, "model", 1, scaled_model(2.0))
    add_version(tmp_path, "other", 1, scaled_model(3.0))
    service = InferenceService.from_repository(tmp_path, model_control_mode="explicit", load_models=["model"])
    app = create_app(service=service)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server") as client:
            index = (await client.post("/v2/repository/index")).json()  # tritonclient posts an empty body
            assert [(e["name"], e["state"]) for e in index] == [("model", "READY"), ("other", "UNAVAILABLE")]
            ready = (await client.post("/v2/repository/index", json={"ready": True})).json()
            assert [e["name"] for e in ready] == ["model"]
            bad = await client.post("/v2/repository/index", json={"ready": "yes"})
            assert bad.status_code == 400 and "'ready' must be true or false" in bad.json()["error"]
            config = json.dumps({"max_batch_size": 2, "dynamic_batching": {}})
            response = await client.post("/v2/repository/models/other/load", json={"parameters": {"config": config}})
            assert response.status_code == 200, response.text
            assert (await client.get("/v2/models/other/config")).json()["max_batch_size"] == 2
            for body, fragment in [({"parameters": {"config": "{nope"}}, "the 'config' parameter is not valid JSON"),
                                   ({"parameters": {"file:1/model.onnx": "AAAA"}}, "put the files in the model"),
                                   ({"parameters": {"config": "[1]"}}, "must be a model configuration")]:
                response = await client.post("/v2/repository/models/other/load", json=body)
                assert response.status_code == 400 and fragment in response.json()["error"], response.text
            response = await client.post("/v2/repository/models/other/unload",
                                         json={"parameters": {"unload_dependents": False}})
            assert response.status_code == 200
            assert (await client.get("/v2/models/other/ready")).status_code == 503
            missing = await client.post("/v2/repository/models/ghost/load")
            assert missing.status_code == 404 and "no model 'ghost'" in missing.json()["error"]


# -- the config reader and the JSON form ---------------------------------------------------------------
def test_the_text_format_reader_takes_what_triton_configs_use(tmp_path):
    path = tmp_path / "config.pbtxt"
    path.write_text('''
        name: "m"   # a comment
        max_batch_size: 0x10
        version_policy < specific { versions: 2 versions: [3, 1] } >;
        instance_group [ { count: 2, kind: KIND_GPU, gpus: [ 0 ] }, { count: 1 kind: KIND_GPU } ],
        parameters [ { key: "threads" value { string_value: "4" } } ]
        parameters { key: 'note' value: { string_value: "tab\\there " "and more" } }
        dynamic_batching { }
        default_model_filename: "net.onnx"
    ''')
    config = read_config_file(path)
    assert config.name == "m" and config.max_batch_size == 16
    assert config.version_policy == {"specific": {"versions": [1, 2, 3]}}
    assert config.instance_count == 3 and config.instance_kind == "KIND_GPU"
    assert config.parameters == {"threads": "4", "note": "tab\there and more"}
    settings = config.settings(ModelSettings(backend="cpu", max_delay=0.005))
    assert settings.backend == "gpu_compute" and settings.instances == 3 and settings.threads == 4
    assert settings.dynamic_batching and settings.max_delay == 0  # Triton's default delay inside the block
    assert settings.model_filename == "net.onnx"


def test_the_json_config_reads_back_the_same_settings(digits_model):
    settings = ModelSettings(backend="cpu", dynamic_batching=True, max_batch_size=16, max_delay=0.003, threads=2,
                             instances=4, parameters={"threads": "2"})
    config = triton_config("digits", digits_model, settings, 16)
    again = config_from_json(json.loads(json.dumps(config))).settings(ModelSettings())
    assert (again.max_batch_size, again.dynamic_batching, again.max_delay, again.instances, again.threads,
            again.backend) == (16, True, 0.003, 4, 2, "cpu")


@pytest.mark.anyio
async def test_kind_gpu_runs_on_gpu_compute_or_says_why_not(tmp_path):
    add_version(tmp_path, "model", 1, scaled_model(2.0))
    (tmp_path / "model" / "config.pbtxt").write_text("instance_group [ { kind: KIND_GPU } ]\n")
    async with running(tmp_path, strict_readiness=False) as service:
        served = service.models["model"]
        assert served.settings.backend == "gpu_compute"
        if served.state.value == "READY":  # a CUDA device is here
            np.testing.assert_allclose((await infer(service, "model", X))["y"], X * 2, rtol=1e-6)
            assert service.model_config("model")["instance_group"][0]["kind"] == "KIND_GPU"
        else:  # no device: the worker could not be built, and the index says why
            entry = service.repository_index()[0]
            assert entry["state"] == "UNAVAILABLE"
            assert "the worker could not be built: BackendUnavailableError" in entry["reason"]


def ranged_model() -> onnx.ModelProto:
    """y = Range(0, limit, delta): zeros ask for a step of 0, which no run can take."""
    start = helper.make_tensor("start", TensorProto.FLOAT, [], [0.0])
    return make_model([helper.make_node("Range", ["start", "limit", "delta"], ["y"])],
                      [tensor_info("limit", []), tensor_info("delta", [])], [tensor_info("y", None)], [start],
                      extra_domains=())


def branching_model() -> onnx.ModelProto:
    """y = relu(x) + sigmoid(-x) on [N, 3]: two branches, so its CPU runs are tuned (serial or
    parallel) by its first runs (a model of one path runs serial from the first)."""
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["x"], ["b"]),
             helper.make_node("Sigmoid", ["b"], ["c"]), helper.make_node("Add", ["a", "c"], ["y"])]
    return make_model(nodes, [tensor_info("x", ["N", 3])], [tensor_info("y", ["N", 3])], [], extra_domains=())


@pytest.mark.anyio
@pytest.mark.parametrize("repository", [False, True])
async def test_warmup_runs_each_model_before_it_is_ready(repository, tmp_path, caplog):
    """With ``warmup=True`` a model is READY after a run on zeros (its CPU run mode chosen), and
    one that zeros cannot run is served all the same, the log saying why; off by default."""
    models = {"scaled": scaled_model(2.0), "ranged": ranged_model(), "branching": branching_model()}
    if repository:
        for name, proto in models.items():
            add_version(tmp_path, name, 1, proto)
        make = lambda **options: InferenceService.from_repository(tmp_path, **options)  # noqa: E731
    else:
        make = lambda **options: InferenceService(models, **options)  # noqa: E731
    caplog.set_level("INFO", logger="asyncinfer.serving.served")
    async with make(warmup=True) as service:
        scaled, ranged = service.models["scaled"], service.models["ranged"]
        assert scaled.settings.warmup and ranged.state.name == scaled.state.name == "READY"
        assert service.models["branching"].worker._run_mode.mode != "deciding"
        answer = await ranged.worker.run({"limit": np.float32(3), "delta": np.float32(1)})
        np.testing.assert_array_equal(answer["y"], [0, 1, 2])  # the worker serves after its failed warm-up
    assert "'ranged' version 1: warm-up on zeros skipped" in caplog.text
    async with make() as service:
        assert not service.models["scaled"].settings.warmup
        assert service.models["branching"].worker._run_mode.mode == "deciding"
