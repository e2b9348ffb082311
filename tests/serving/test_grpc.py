"""The gRPC endpoint (KServe v2 ``inference.GRPCInferenceService``), checked against Triton's client.

Three parts: the proto is wire-compatible with the one tritonclient.grpc was generated from
(descriptors compared field by field); the message <-> array conversions; and the server itself,
started on port 0 inside the test's event loop and driven by tritonclient.grpc's blocking client
on a worker thread (its stream and async_infer callbacks run on the client's own threads).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import numpy as np
import pytest
from onnx import TensorProto, helper

import asyncinfer as ai
from asyncinfer import assets
from asyncinfer.ops.base import Op
from asyncinfer.ops.registry import register
from asyncinfer.serving.protocol import InferRequest, ProtocolError, unpack_bytes
from conftest import TEST_DOMAIN, make_model, tensor_info

grpc = pytest.importorskip("grpc", reason="the gRPC endpoint needs grpcio (the serve extra)")
pb = pytest.importorskip("asyncinfer.serving.grpc.grpc_service_pb2", reason="needs protobuf (the serve extra)")

import tritonclient.grpc as tc  # noqa: E402 - the reference client (dev extra)
from google.protobuf import descriptor_pb2  # noqa: E402
from tritonclient.grpc import model_config_pb2 as triton_config  # noqa: E402
from tritonclient.grpc import service_pb2 as triton_service  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from asyncinfer.serving.grpc import convert, start_grpc_server  # noqa: E402
from asyncinfer.serving.grpc import server as grpc_server  # noqa: E402
from asyncinfer.serving.service import InferenceService  # noqa: E402

PROTO = Path(convert.__file__).with_name("grpc_service.proto")
REPO = Path(convert.__file__).resolve().parents[3]


# -- the proto against Triton's ------------------------------------------------------------------
def _messages(descriptor):
    """Every message of a file or message descriptor, nested ones included."""
    children = descriptor.message_types_by_name.values() if hasattr(descriptor, "message_types_by_name") \
        else descriptor.nested_types
    for message in children:
        yield message
        yield from _messages(message)


def _enums(descriptor):
    yield from descriptor.enum_types_by_name.values()
    for message in _messages(descriptor):
        yield from message.enum_types


def _field_signature(field):
    target = field.message_type or field.enum_type
    return (field.name, field.type, field.is_repeated, target.full_name if target else None,
            field.containing_oneof.name if field.containing_oneof else None)


def _triton_message(full_name):
    for module in (triton_service, triton_config):
        try:
            return module.DESCRIPTOR.pool.FindMessageTypeByName(full_name)
        except KeyError:
            continue
    raise AssertionError(f"tritonclient has no message {full_name}")


def test_every_message_matches_tritons_field_by_field():
    """Same full names, and every field with the same number, name, type, label, target type and
    oneof; messages of Triton's grpc_service.proto have all their fields (the RPCs carry them
    whole), ModelConfig and its parts the declared subset."""
    triton_rpc_messages = {m.full_name for m in _messages(triton_service.DESCRIPTOR)}
    checked = set()
    for mine in _messages(pb.DESCRIPTOR):
        theirs = _triton_message(mine.full_name)
        assert mine.GetOptions().map_entry == theirs.GetOptions().map_entry, mine.full_name
        their_fields = {f.number: f for f in theirs.fields}
        for field in mine.fields:
            assert field.number in their_fields, f"{mine.full_name}.{field.name}: no field {field.number} in Triton's"
            assert _field_signature(field) == _field_signature(their_fields[field.number]), \
                f"{mine.full_name} field {field.number}"
        if mine.full_name in triton_rpc_messages:
            missing = sorted(f.name for n, f in their_fields.items() if n not in {f.number for f in mine.fields})
            assert not missing, f"{mine.full_name} lacks Triton's fields {missing}"
        checked.add(mine.full_name)
    assert triton_rpc_messages <= checked, sorted(triton_rpc_messages - checked)  # every RPC's messages, whole
    config_fields = {f.name for f in pb.ModelConfig.DESCRIPTOR.fields}
    assert config_fields >= {"name", "platform", "backend", "max_batch_size", "input", "output",
                             "dynamic_batching", "instance_group", "version_policy"}


def test_enums_match_tritons():
    for mine in _enums(pb.DESCRIPTOR):
        theirs = None
        for module in (triton_service, triton_config):
            try:
                theirs = module.DESCRIPTOR.pool.FindEnumTypeByName(mine.full_name)
                break
            except KeyError:
                continue
        assert theirs is not None, mine.full_name
        assert {v.name: v.number for v in mine.values} == {v.name: v.number for v in theirs.values}, mine.full_name


def test_service_has_every_rpc_of_tritons():
    mine = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs = triton_service.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert mine.full_name == "inference.GRPCInferenceService"
    assert {m.name for m in mine.methods} == {m.name for m in theirs.methods}
    for method in theirs.methods:
        own = mine.methods_by_name[method.name]
        assert (own.input_type.full_name, own.output_type.full_name) == \
            (method.input_type.full_name, method.output_type.full_name), method.name
        assert (own.client_streaming, own.server_streaming) == (method.client_streaming, method.server_streaming)


def test_messages_cross_the_wire_both_ways():
    """A request built with asyncinfer's classes parses with Triton's, and back."""
    request = pb.ModelInferRequest(model_name="m", model_version="2", id="7")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[2, 2])
    tensor.contents.fp32_contents.extend([1, 2, 3, 4])
    request.parameters["priority"].int64_param = 3
    request.outputs.add(name="y").parameters["binary_data"].bool_param = True
    request.raw_input_contents.append(b"\x00\x01")
    theirs = triton_service.ModelInferRequest.FromString(request.SerializeToString())
    assert theirs.inputs[0].contents.fp32_contents == [1, 2, 3, 4]
    assert theirs.parameters["priority"].int64_param == 3 and theirs.outputs[0].parameters["binary_data"].bool_param
    assert pb.ModelInferRequest.FromString(theirs.SerializeToString()) == request

    config = triton_config.ModelConfig(name="m", platform="onnxruntime_onnx", max_batch_size=8, backend="cpu")
    config.input.add(name="x", data_type=triton_config.TYPE_FP32, dims=[1, 8, 8])
    config.dynamic_batching.preferred_batch_size.append(4)
    config.instance_group.add(kind=triton_config.ModelInstanceGroup.KIND_CPU, count=2)
    config.version_policy.latest.num_versions = 1
    assert triton_config.ModelConfig.FromString(pb.ModelConfig.FromString(config.SerializeToString())
                                                .SerializeToString()) == config


def test_shipped_code_is_generated_from_the_proto():
    """The shipped grpc_service_pb2 holds exactly the descriptor protoc makes of the .proto
    (a stale generated file would fail here)."""
    protoc = pytest.importorskip("grpc_tools.protoc", reason="grpcio-tools regenerates the code")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        status = protoc.main(["protoc", f"-I{REPO}", f"--descriptor_set_out={out}",
                              str(PROTO.relative_to(REPO))])
        assert status == 0
        fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    _clear_json_names(fresh.message_type)  # protoc's Python code leaves them out
    shipped = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    assert shipped == fresh


def _clear_json_names(messages):
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        _clear_json_names(message.nested_type)


def test_imports_beside_tritonclient_and_onnx_in_either_order():
    """asyncinfer's messages live in a private descriptor pool: Triton's client registers the same
    inference.* names in the default pool, and both must load in one process, without warnings."""
    for first, second in [("tritonclient.grpc", "asyncinfer.serving.grpc"),
                          ("asyncinfer.serving.grpc", "tritonclient.grpc")]:
        code = (f"import onnx, {first}, {second}\n"
                "from asyncinfer.serving.grpc import grpc_service_pb2 as pb\n"
                "from tritonclient.grpc import service_pb2 as t\n"
                "assert pb.ServerLiveRequest is not t.ServerLiveRequest\n"
                "assert pb.ModelInferRequest.FromString(t.ModelInferRequest(id='a').SerializeToString()).id == 'a'\n"
                "onnx.load_from_string(onnx.ModelProto(ir_version=8).SerializeToString())\n")
        result = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True,
                                cwd=REPO, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]


def test_regenerate_refuses_an_unpinned_grpcio_tools(monkeypatch, capsys):
    from asyncinfer.serving.grpc import regenerate

    monkeypatch.setattr(regenerate.metadata, "version", lambda name: "0.0.1")
    assert regenerate.main([]) == 2
    assert regenerate.PINNED_TOOLS in capsys.readouterr().err
    with pytest.raises(SystemExit, match="register its file once"):
        regenerate._use_private_pool("DESCRIPTOR = something_else()")


# -- conversions ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def typed_model() -> ai.Model:
    """Identity on one input of each datatype family: BYTES, BOOL, FP16, INT8, UINT16, FP32, INT64."""
    specs = [("s", ["N"], TensorProto.STRING), ("b", [2], TensorProto.BOOL), ("h", [2], TensorProto.FLOAT16),
             ("i8", [3], TensorProto.INT8), ("u16", [3], TensorProto.UINT16), ("f", ["N", 2], TensorProto.FLOAT),
             ("l", [2], TensorProto.INT64)]
    nodes = [helper.make_node("Identity", [n], [n + "_out"]) for n, _, _ in specs]
    proto = make_model(nodes, [tensor_info(n, shape, t) for n, shape, t in specs],
                       [tensor_info(n + "_out", None, t) for n, _, t in specs], extra_domains=())
    return ai.load_model(proto)


TYPED_INPUTS = {
    "s": np.array([b"ab", b"", "é".encode()], dtype=object),
    "b": np.array([True, False]),
    "h": np.array([1.5, -2.0], np.float16),
    "i8": np.array([1, -128, 127], np.int8),
    "u16": np.array([0, 65535, 7], np.uint16),
    "f": np.arange(6, dtype=np.float32).reshape(3, 2),
    "l": np.array([-(2 ** 40), 5], np.int64),
}
TYPED_FIELD = {"s": "bytes_contents", "b": "bool_contents", "i8": "int_contents", "u16": "uint_contents",
               "f": "fp32_contents", "l": "int64_contents"}
LIMITS = ai.Limits()


def _raw_request(inputs, skip=()):
    request = pb.ModelInferRequest(model_name="typed")
    for name, array in inputs.items():
        if name in skip:
            continue
        request.inputs.add(name=name, datatype=convert.datatype_of(array.dtype), shape=array.shape)
        request.raw_input_contents.append(convert.to_raw(array))
    return request


def _typed_request(inputs):
    request = pb.ModelInferRequest(model_name="typed")
    for name, array in inputs.items():
        tensor = request.inputs.add(name=name, datatype=convert.datatype_of(array.dtype), shape=array.shape)
        getattr(tensor.contents, TYPED_FIELD[name]).extend(array.ravel().tolist())
    return request


def _assert_same(decoded, expected):
    assert set(decoded) == set(expected)
    for name, array in expected.items():
        assert decoded[name].dtype == array.dtype, name
        assert decoded[name].shape == array.shape, name
        assert decoded[name].tolist() == array.tolist(), name


def test_decode_raw_contents_of_every_datatype(typed_model):
    parsed = convert.decode_infer_request(_raw_request(TYPED_INPUTS), typed_model, "typed", LIMITS)
    _assert_same(parsed.inputs, TYPED_INPUTS)
    assert parsed.outputs == [o.name for o in typed_model.outputs] and parsed.id is None


def test_decode_typed_contents(typed_model):
    typed = {k: v for k, v in TYPED_INPUTS.items() if k != "h"}
    parsed = convert.decode_infer_request(_typed_request(typed), _model_without(typed_model, "h"), "typed", LIMITS)
    _assert_same(parsed.inputs, typed)
    request = _typed_request(typed)  # FP16 has no typed list: it travels raw only
    request.inputs.add(name="h", datatype="FP16", shape=[2]).contents.fp32_contents.extend([1.5, -2.0])
    with pytest.raises(ProtocolError, match="FP16 data has no typed contents field"):
        convert.decode_infer_request(request, typed_model, "typed", LIMITS)


def _model_without(model, name):
    """The same model declaring one input fewer (to decode requests that leave it out)."""
    return dataclasses.replace(model, inputs=[i for i in model.inputs if i.name != name])


def _set_shape(request, index, shape):
    del request.inputs[index].shape[:]
    request.inputs[index].shape.extend(shape)


def _ask_classification(request):
    request.outputs.add(name="f_out").parameters["classification"].int64_param = 3


def test_bool_raw_bytes_other_than_one_are_true(typed_model):
    request = _raw_request(TYPED_INPUTS)
    index = [t.name for t in request.inputs].index("b")
    request.raw_input_contents[index] = b"\x02\x00"
    assert convert.decode_infer_request(request, typed_model, "t", LIMITS).inputs["b"].tolist() == [True, False]


@pytest.mark.parametrize("mutate, message", [
    (lambda r: setattr(r.inputs[0], "name", "nope"), "unknown input 'nope'"),
    (lambda r: r.raw_input_contents.pop(), "raw_input_contents has 6 entries for 7 inputs"),
    (lambda r: _set_shape(r, 5, [-1, 2]), "non-negative"),
    (lambda r: _set_shape(r, 5, [1] * 40), "max_tensor_rank"),
    (lambda r: _set_shape(r, 5, [1 << 20, 1 << 20]), "max_tensor_elements"),
    (lambda r: setattr(r.inputs[5], "datatype", "FP64"), "has datatype FP32 in model 'typed', the request says 'FP64'"),
    (lambda r: setattr(r.inputs[5], "datatype", "FP8"), "unknown datatype"),
    (lambda r: _set_shape(r, 5, [2, 2]), "needs 4 elements = 16 bytes"),
    (lambda r: r.inputs[5].contents.fp32_contents.append(1.0), "both in raw_input_contents and in contents"),
    (lambda r: r.outputs.add(name="zzz"), "unknown output 'zzz'"),
    (_ask_classification, "classification extension is not supported"),
])
def test_decode_errors_name_what_is_wrong(typed_model, mutate, message):
    request = _raw_request(TYPED_INPUTS)
    mutate(request)
    with pytest.raises(ProtocolError, match=message.replace("(", r"\(").replace("[", r"\[")) as caught:
        convert.decode_infer_request(request, typed_model, "typed", LIMITS)
    assert caught.value.status == 400


def test_decode_rejects_missing_and_repeated_inputs(typed_model):
    with pytest.raises(ProtocolError, match=r"missing input\(s\) \['l'\]"):
        convert.decode_infer_request(_raw_request(TYPED_INPUTS, skip={"l"}), typed_model, "typed", LIMITS)
    request = _raw_request(TYPED_INPUTS)
    request.inputs.add(name="l", datatype="INT64", shape=[2])
    request.raw_input_contents.append(convert.to_raw(TYPED_INPUTS["l"]))
    with pytest.raises(ProtocolError, match="given twice"):
        convert.decode_infer_request(request, typed_model, "typed", LIMITS)


@pytest.mark.parametrize("name, field, values, message", [
    ("i8", "int_contents", [1, 2, 300], "out of the range of INT8"),
    ("u16", "uint_contents", [1, 2, 70000], "out of the range of UINT16"),
    ("f", "int64_contents", [1, 2, 3, 4, 5, 6], "FP32, whose data goes in contents.fp32_contents"),
    ("f", "fp32_contents", [1, 2, 3], "needs 6 elements, contents.fp32_contents has 3"),
])
def test_typed_contents_errors(typed_model, name, field, values, message):
    typed = {k: v for k, v in TYPED_INPUTS.items() if k != "h"}
    request = _typed_request(typed)
    tensor = next(t for t in request.inputs if t.name == name)
    tensor.contents.Clear()
    getattr(tensor.contents, field).extend(values)
    with pytest.raises(ProtocolError, match=message):
        convert.decode_infer_request(request, _model_without(typed_model, "h"), "typed", LIMITS)


@pytest.mark.parametrize("chunk, message", [
    (b"\x02\x00\x00", "ends inside a 4-byte length prefix"),
    (b"\x09\x00\x00\x00ab", "overruns the data"),
    (b"\x01\x00\x00\x00a" * 2, "needs 3 elements, the BYTES data holds 2"),
    (b"\x00\x00\x00\x00" * 4, "holds more"),
])
def test_bytes_wire_form_errors(chunk, message):
    with pytest.raises(ProtocolError, match=message):
        unpack_bytes("s", chunk, 3)


def test_encode_reads_back_with_tritons_result_class(typed_model):
    """What asyncinfer encodes, tritonclient's InferResult decodes to the same arrays."""
    from tritonclient.grpc import InferResult

    outputs = {name + "_out": array for name, array in TYPED_INPUTS.items()}
    request = InferRequest("req-1", {}, list(outputs))
    response = convert.encode_infer_response("typed", "1", request, outputs)
    result = InferResult(triton_service.ModelInferResponse.FromString(response.SerializeToString()))
    assert result.get_response().id == "req-1" and result.get_response().model_version == "1"
    for name, array in outputs.items():
        got = result.as_numpy(name)
        assert got.shape == array.shape, name
        assert got.tolist() == array.tolist(), name


def test_json_form_dicts_become_messages():
    config = convert.from_json({
        "name": "digits", "platform": "onnxruntime_onnx", "backend": "asyncinfer", "max_batch_size": 32,
        "input": [{"name": "image", "data_type": "TYPE_FP32", "dims": [1, 8, 8], "format": "FORMAT_NONE"}],
        "output": [{"name": "logits", "data_type": "TYPE_FP32", "dims": [10]}],
        "dynamic_batching": {"preferred_batch_size": [32], "max_queue_delay_microseconds": 2000},
        "instance_group": [{"name": "digits", "kind": "KIND_CPU", "count": 1}],
        "version_policy": {"latest": {"num_versions": 1}},
        "optimization": {"priority": "PRIORITY_DEFAULT"},  # a Triton field asyncinfer's proto leaves out
    }, pb.ModelConfig)
    assert config.input[0].data_type == pb.TYPE_FP32 and list(config.input[0].dims) == [1, 8, 8]
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    assert config.instance_group[0].kind == pb.ModelInstanceGroup.KIND_CPU
    index = convert.repository_index_response([{"name": "a", "version": "1", "state": "READY", "reason": ""}])
    assert index.models[0].state == "READY"
    parameters = pb.RepositoryModelLoadRequest().parameters
    parameters["config"].string_param = "{}"
    parameters["file:1/model.onnx"].bytes_param = b"x"
    assert convert.repository_parameters(parameters) == {"config": "{}", "file:1/model.onnx": b"x"}


# -- the server, driven by tritonclient.grpc -------------------------------------------------------
# tritonclient's client blocks: every call goes through a worker thread (`_call`), so the server,
# in the test's event loop, keeps serving meanwhile.
RTOL, ATOL = 1e-5, 1e-5  # a batched GEMM may sum in another order than a batch of one
MAX_REQUEST_BYTES = 4 << 20
RELEASE = threading.Event()  # lets the Hold op's runs finish


@register("GrpcTestHold", versions=(1,), domain=TEST_DOMAIN)
class Hold(Op):
    """Identity that holds its CPU thread until RELEASE is set: a run that is still going."""

    def run(self, x):
        RELEASE.wait(timeout=30)
        return x.copy()


@pytest.fixture(scope="module")
def hold_model() -> ai.Model:
    proto = make_model([helper.make_node("GrpcTestHold", ["x"], ["y"], domain=TEST_DOMAIN)],
                       [tensor_info("x", ["N", 2])], [tensor_info("y", ["N", 2])])
    return ai.load_model(proto)


@asynccontextmanager
async def serving(service: InferenceService):
    """``service`` started, with a gRPC server on a free port; yields a connected Triton client
    (its ``url`` attribute: the server's address)."""
    async with service:
        server = await start_grpc_server(service, "127.0.0.1", 0)
        client = tc.InferenceServerClient(f"127.0.0.1:{server.port}")
        client.url = f"127.0.0.1:{server.port}"
        try:
            yield client
        finally:
            client.close()
            await server.stop(None)


async def _call(fn, *args, **kwargs):
    return await asyncio.to_thread(fn, *args, **kwargs)


def _input(name, array, datatype=None):
    tensor = tc.InferInput(name, list(array.shape), datatype or convert.datatype_of(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor


async def _error(fn, *args, **kwargs) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        await _call(fn, *args, **kwargs)
    return caught.value


def _service(models, **options) -> InferenceService:
    return InferenceService(models, limits=ai.Limits(max_request_bytes=MAX_REQUEST_BYTES), **options)


@pytest.mark.asyncio
async def test_health_metadata_config_and_index(digits_model, typed_model):
    async with serving(_service({"digits": digits_model, "typed": typed_model})) as client:
        assert await _call(client.is_server_live) and await _call(client.is_server_ready)
        assert await _call(client.is_model_ready, "digits")
        assert await _call(client.is_model_ready, "digits", "1")
        metadata = await _call(client.get_server_metadata)
        assert metadata.name == "asyncinfer" and "model_configuration" in metadata.extensions
        model = await _call(client.get_model_metadata, "digits")
        assert (model.name, list(model.versions)) == ("digits", ["1"])
        assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == [("image", "FP32", [-1, 1, 8, 8])]
        assert [t.name for t in model.outputs] == ["logits", "probabilities"]
        config = (await _call(client.get_model_config, "digits")).config
        assert config.name == "digits" and config.platform == "onnxruntime_onnx" and config.max_batch_size == 32
        assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [("image", triton_config.TYPE_FP32, [1, 8, 8])]
        assert [o.name for o in config.output] == ["logits", "probabilities"]
        assert config.HasField("dynamic_batching") and config.instance_group[0].kind == triton_config.ModelInstanceGroup.KIND_CPU
        assert config.version_policy.latest.num_versions == 1
        as_json = await _call(client.get_model_config, "digits", as_json=True)
        assert as_json["config"]["max_batch_size"] == 32  # the client's own JSON view parses too
        index = await _call(client.get_model_repository_index)
        assert sorted((m.name, m.version, m.state) for m in index.models) == [("digits", "1", "READY"), ("typed", "1", "READY")]

        assert (await _error(client.get_model_metadata, "nope")).status() == "StatusCode.NOT_FOUND"
        assert (await _error(client.is_model_ready, "digits", "7")).status() == "StatusCode.NOT_FOUND"
        assert (await _error(client.get_model_config, "nope")).status() == "StatusCode.NOT_FOUND"


@pytest.mark.asyncio
async def test_infer_matches_a_direct_worker_run_and_is_counted(digits_model, digits_samples):
    images = digits_samples[0][:8]
    async with ai.Worker(digits_model, "cpu") as worker:
        expected = await worker.run({"image": images})
    async with serving(_service({"digits": digits_model})) as client:
        result = await _call(client.infer, "digits", [_input("image", images)], request_id="r-1")
        assert result.get_response().id == "r-1" and result.get_response().model_version == "1"
        for name in ("logits", "probabilities"):
            np.testing.assert_allclose(result.as_numpy(name), expected[name], rtol=RTOL, atol=ATOL)

        # only the outputs asked for, in the order asked
        result = await _call(client.infer, "digits", [_input("image", images[:2])],
                             outputs=[tc.InferRequestedOutput("probabilities")])
        assert [o.name for o in result.get_response().outputs] == ["probabilities"]
        assert result.as_numpy("logits") is None
        np.testing.assert_allclose(result.as_numpy("probabilities"), expected["probabilities"][:2], rtol=RTOL, atol=ATOL)

        # typed contents, with Triton's own message classes and stub
        request = triton_service.ModelInferRequest(model_name="digits", id="typed")
        tensor = request.inputs.add(name="image", datatype="FP32", shape=[3, 1, 8, 8])
        tensor.contents.fp32_contents.extend(images[:3].ravel().tolist())
        with grpc.insecure_channel(client.url) as channel:
            response = await _call(tc.service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer, request)
        typed_result = tc.InferResult(response)
        np.testing.assert_allclose(typed_result.as_numpy("logits"), expected["logits"][:3], rtol=RTOL, atol=ATOL)

        # async_infer: the answer comes to a callback
        answers = queue.Queue()
        await _call(client.async_infer, "digits", [_input("image", images[3:5])],
                    callback=lambda result, error: answers.put((result, error)), request_id="async")
        result, error = await _call(answers.get, timeout=30)
        assert error is None and result.get_response().id == "async"
        np.testing.assert_allclose(result.as_numpy("logits"), expected["logits"][3:5], rtol=RTOL, atol=ATOL)

        stats = (await _call(client.get_inference_statistics, "digits")).model_stats
        assert [(s.name, s.version) for s in stats] == [("digits", "1")]
        inference = stats[0].inference_stats
        assert inference.success.count == 4 and inference.fail.count == 0
        assert inference.compute_input.count == 4 and inference.compute_output.count == 4
        assert inference.compute_infer.ns > 0
        assert stats[0].inference_count == 8 + 2 + 3 + 2  # rows

        await _error(client.infer, "digits", [_input("image", images[:1, :, :4])])
        stats = (await _call(client.get_inference_statistics, "digits", "1")).model_stats
        assert stats[0].inference_stats.fail.count == 1 and stats[0].inference_stats.success.count == 4


@pytest.mark.asyncio
async def test_every_datatype_round_trips(typed_model):
    """BYTES, BOOL, FP16, INT8, UINT16, FP32 and INT64 through Triton's client and back unchanged."""
    async with serving(_service({"typed": typed_model}, batching=False)) as client:
        result = await _call(client.infer, "typed", [_input(name, array) for name, array in TYPED_INPUTS.items()])
        for name, array in TYPED_INPUTS.items():
            got = result.as_numpy(name + "_out")
            assert got.shape == array.shape and got.tolist() == array.tolist(), name


@pytest.mark.asyncio
async def test_bad_requests_get_clear_status_codes_and_the_server_stays_up(digits_model, digits_samples, monkeypatch):
    images = digits_samples[0]
    async with serving(_service({"digits": digits_model})) as client:
        error = await _error(client.infer, "nope", [_input("image", images[:1])])
        assert error.status() == "StatusCode.NOT_FOUND" and "unknown model 'nope'" in error.message()
        error = await _error(client.infer, "digits", [_input("image", images[:1, :, :4])])  # the engine's InputError
        assert error.status() == "StatusCode.INVALID_ARGUMENT" and "image" in error.message()
        error = await _error(client.infer, "digits", [_input("picture", images[:1])])
        assert error.status() == "StatusCode.INVALID_ARGUMENT" and "unknown input 'picture'" in error.message()
        error = await _error(client.infer, "digits", [_input("image", images[:1].astype(np.float64))])
        assert error.status() == "StatusCode.INVALID_ARGUMENT" and "FP64" in error.message()
        error = await _error(client.infer, "digits", [_input("image", images[:1])],
                             outputs=[tc.InferRequestedOutput("nope")])
        assert error.status() == "StatusCode.INVALID_ARGUMENT" and "unknown output 'nope'" in error.message()

        # over Limits.max_request_bytes: refused by gRPC before it is decoded
        big = np.zeros((MAX_REQUEST_BYTES // 256 + 1, 1, 8, 8), np.float32)
        error = await _error(client.infer, "digits", [_input("image", big)])
        assert error.status() == "StatusCode.RESOURCE_EXHAUSTED"

        # a large request (over 1 MiB, under the limit) is decoded and encoded on a worker thread
        offloaded = []
        real = grpc_server.anyio.to_thread.run_sync

        async def spy(fn, *args, **kwargs):
            offloaded.append(fn.__name__)
            return await real(fn, *args, **kwargs)

        monkeypatch.setattr(grpc_server.anyio.to_thread, "run_sync", spy)
        rows = np.tile(images, (6000 // len(images) + 1, 1, 1, 1))[:6000]  # 1.5 MB of input
        result = await _call(client.infer, "digits", [_input("image", rows)])
        assert result.as_numpy("logits").shape == (6000, 10)
        assert {"FromString", "decode_infer_request"} <= set(offloaded)  # parsing the message, then decoding
        monkeypatch.undo()

        with grpc.insecure_channel(client.url) as channel:  # bytes that are no ModelInferRequest
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            with pytest.raises(grpc.RpcError) as caught:
                await _call(infer, b"\xff\xff\xff")
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid inference.ModelInferRequest" in caught.value.details()
            stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
            good = triton_service.ModelInferRequest(model_name="digits", id="ok")
            good.inputs.add(name="image", datatype="FP32", shape=[1, 1, 8, 8])
            good.raw_input_contents.append(images[:1].tobytes())
            answers = await _call(lambda: [triton_service.ModelStreamInferResponse.FromString(a)
                                           for a in stream(iter([b"\xff\xff", good.SerializeToString()]))])
            assert "not a valid" in answers[0].error_message
            assert answers[1].error_message == "" and answers[1].infer_response.id == "ok"

        assert await _call(client.is_server_ready)  # and still answering
        stats = (await _call(client.get_inference_statistics, "digits")).model_stats[0].inference_stats
        assert stats.success.count == 2 and stats.fail.count == 4  # NOT_FOUND, oversized, malformed never reached it


@pytest.mark.asyncio
async def test_stream_answers_in_order_and_goes_on_after_an_error(digits_model, digits_samples):
    images = digits_samples[0]
    async with ai.Worker(digits_model, "cpu") as worker:
        expected = await worker.run({"image": images[:12]})
    async with serving(_service({"digits": digits_model})) as client:
        answers = queue.Queue()
        await _call(client.start_stream, callback=lambda result, error: answers.put((result, error)))
        sizes = [1, 3, 2, 4, 2]
        start = 0
        for index, size in enumerate(sizes):
            batch = images[start:start + size] if index != 2 else images[:size, :, :4]  # request 2 is malformed
            await _call(client.async_stream_infer, "digits", [_input("image", batch)], request_id=f"s{index}")
            start += size
        got = [await _call(answers.get, timeout=30) for _ in sizes]
        await _call(client.stop_stream)
        start = 0
        for index, (size, (result, error)) in enumerate(zip(sizes, got)):
            if index == 2:
                assert result is None and "image" in str(error)
            else:
                assert error is None and result.get_response().id == f"s{index}"
                np.testing.assert_allclose(result.as_numpy("logits"), expected["logits"][start:start + size],
                                           rtol=RTOL, atol=ATOL)
            start += size
        stats = (await _call(client.get_inference_statistics, "digits")).model_stats[0].inference_stats
        assert (stats.success.count, stats.fail.count) == (4, 1)


@pytest.mark.asyncio
async def test_shared_memory_is_unsupported_and_settings_are_read_only(digits_model):
    async with serving(_service({"digits": digits_model})) as client:
        calls = [
            (client.get_system_shared_memory_status, ()),
            (client.register_system_shared_memory, ("region", "/key", 64)),
            (client.unregister_system_shared_memory, ()),
            (client.get_cuda_shared_memory_status, ()),
            (client.register_cuda_shared_memory, ("region", b"aGFuZGxl", 0, 64)),  # base64 of a handle
            (client.unregister_cuda_shared_memory, ()),
        ]
        for fn, args in calls:
            error = await _error(fn, *args)
            assert error.status() == "StatusCode.UNIMPLEMENTED", fn.__name__
            assert "shared memory is not supported" in error.message(), fn.__name__
        trace = await _call(client.get_trace_settings)
        assert list(trace.settings["trace_level"].value) == ["OFF"]
        trace = await _call(client.update_trace_settings, model_name="digits",
                            settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
        assert list(trace.settings["trace_level"].value) == ["TIMESTAMPS"]
        assert list(trace.settings["trace_rate"].value) == ["1"]
        assert list((await _call(client.get_trace_settings)).settings["trace_level"].value) == ["OFF"]  # server's
        error = await _error(client.update_trace_settings, settings={"trace_level": ["TENSORS"]})
        assert error.status() == "StatusCode.INVALID_ARGUMENT" and "not supported" in error.message()
        error = await _error(client.update_trace_settings, settings={"trace_file": ["/etc/passwd"]})
        assert error.status() == "StatusCode.INVALID_ARGUMENT"
        log = await _call(client.get_log_settings)
        assert log.settings["log_error"].bool_param
        error = await _error(client.update_log_settings, settings={"log_info": True})
        assert error.status() == "StatusCode.UNIMPLEMENTED"
        # a fixed set of models: no model control
        error = await _error(client.load_model, "digits")
        assert error.status() == "StatusCode.INVALID_ARGUMENT" and "cannot load" in error.message()


@pytest.mark.asyncio
async def test_explicit_load_and_unload(tmp_path, digits_samples):
    (tmp_path / "digits" / "1").mkdir(parents=True)
    shutil.copy(assets.default_model_path(), tmp_path / "digits" / "1" / "model.onnx")
    service = InferenceService(repository=tmp_path, model_control_mode="explicit")
    async with serving(service) as client:
        index = await _call(client.get_model_repository_index)
        assert [(m.name, m.state) for m in index.models] == [("digits", "UNAVAILABLE")]
        error = await _error(client.infer, "digits", [_input("image", digits_samples[0][:1])])
        assert error.status() == "StatusCode.NOT_FOUND"  # not loaded yet

        await _call(client.load_model, "digits", config=json.dumps({"max_batch_size": 4, "dynamic_batching": {}}))
        assert await _call(client.is_model_ready, "digits")
        assert (await _call(client.get_model_config, "digits")).config.max_batch_size == 4
        result = await _call(client.infer, "digits", [_input("image", digits_samples[0][:2])])
        assert result.as_numpy("logits").shape == (2, 10)
        index = await _call(client.get_model_repository_index, )
        assert [(m.name, m.version, m.state) for m in index.models] == [("digits", "1", "READY")]

        await _call(client.unload_model, "digits")
        assert not await _call(client.is_model_ready, "digits")
        ready = await _call(client.get_model_repository_index)
        assert [m.state for m in ready.models] == ["UNAVAILABLE"]

        error = await _error(client.load_model, "missing")
        assert error.status() == "StatusCode.NOT_FOUND"
        error = await _error(client.load_model, "digits", config="{not json")
        assert error.status() == "StatusCode.INVALID_ARGUMENT" and "not valid JSON" in error.message()
        error = await _error(client.load_model, "digits", files={"file:1/model.onnx": b"onnx"})
        assert error.status() == "StatusCode.UNIMPLEMENTED"


@pytest.mark.asyncio
async def test_a_cancelled_call_cancels_its_request(hold_model):
    RELEASE.clear()
    service = _service({"hold": hold_model}, batching=False, max_queue=1)
    try:
        async with serving(service) as client:
            context = await _call(client.async_infer, "hold", [_input("x", np.ones((1, 2), np.float32))],
                                  callback=lambda result, error: None)
            served = service.models["hold"]
            with anyio.fail_after(30):
                while served.in_flight == 0:  # the request has reached the model
                    await asyncio.sleep(0.01)
                # the model's queue (max_queue=1) is full: UNAVAILABLE, with when to retry
                with grpc.insecure_channel(client.url) as channel:
                    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                                request_serializer=triton_service.ModelInferRequest.SerializeToString)
                    request = triton_service.ModelInferRequest(model_name="hold")
                    request.inputs.add(name="x", datatype="FP32", shape=[1, 2])
                    request.raw_input_contents.append(np.ones((1, 2), np.float32).tobytes())
                    with pytest.raises(grpc.RpcError) as caught:
                        await _call(infer, request)
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "retry-after" in dict(caught.value.trailing_metadata())
                context.cancel()
                while served.in_flight:  # the server let go of it while the op still holds its thread
                    await asyncio.sleep(0.01)
            assert not RELEASE.is_set()
            stats = (await _call(client.get_inference_statistics, "hold")).model_stats[0].inference_stats
            assert (stats.success.count, stats.fail.count) == (0, 2)  # the refused one, the cancelled one
            RELEASE.set()
            result = await _call(client.infer, "hold", [_input("x", np.full((1, 2), 3, np.float32))])
            assert result.as_numpy("y").tolist() == [[3, 3]]  # the model still serves
    finally:
        RELEASE.set()


@pytest.mark.asyncio
async def test_deadlines_the_servers_and_the_clients(hold_model):
    RELEASE.clear()
    service = _service({"hold": hold_model}, batching=False, request_timeout=0.2)
    try:
        async with serving(service) as client:
            x = [_input("x", np.ones((1, 2), np.float32))]
            error = await _error(client.infer, "hold", x)  # past --request-timeout: 504
            assert error.status() == "StatusCode.DEADLINE_EXCEEDED" and "request timeout" in error.message()
            error = await _error(client.infer, "hold", x, client_timeout=0.1)  # the client's own deadline
            assert error.status() == "StatusCode.DEADLINE_EXCEEDED"
            with anyio.fail_after(30):
                while service.models["hold"].in_flight:  # the server gave up on it too
                    await asyncio.sleep(0.01)
            assert not RELEASE.is_set()
            RELEASE.set()  # before the service stops: disposal waits for the held threads
    finally:
        RELEASE.set()


@pytest.mark.asyncio
async def test_servicer_registered_with_the_generated_function_alone(digits_model, digits_samples):
    """The message-level ModelInfer and ModelStreamInfer (used when the servicer is added to a
    server with the generated add_GRPCInferenceServiceServicer_to_server only)."""
    from asyncinfer.serving.grpc import InferenceServicer, grpc_service_pb2_grpc

    images = digits_samples[0][:2]
    async with _service({"digits": digits_model}) as service:
        server = grpc.aio.server()
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(service), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = tc.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            result = await _call(client.infer, "digits", [_input("image", images)])
            assert result.as_numpy("logits").shape == (2, 10)
            answers = queue.Queue()
            await _call(client.start_stream, callback=lambda result, error: answers.put((result, error)))
            await _call(client.async_stream_infer, "digits", [_input("image", images[:1, :, :4])])
            await _call(client.async_stream_infer, "digits", [_input("image", images)], request_id="b")
            first, second = [await _call(answers.get, timeout=30) for _ in range(2)]
            await _call(client.stop_stream)
            assert first[0] is None and "image" in str(first[1])
            assert second[1] is None and second[0].get_response().id == "b"
            np.testing.assert_allclose(second[0].as_numpy("logits"), result.as_numpy("logits"), rtol=RTOL, atol=ATOL)
        finally:
            client.close()
            await server.stop(None)


@pytest.mark.asyncio
async def test_a_port_in_use_is_an_error(digits_model):
    async with _service({"digits": digits_model}) as service:
        server = await start_grpc_server(service, "127.0.0.1", 0)
        try:
            with pytest.raises(OSError, match="cannot serve gRPC"):
                await start_grpc_server(service, "127.0.0.1", server.port)
        finally:
            await server.stop(None)


def test_status_codes_follow_the_contract():
    codes = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 408: "DEADLINE_EXCEEDED", 504: "DEADLINE_EXCEEDED",
             413: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 501: "UNIMPLEMENTED", 503: "UNAVAILABLE",
             418: "INVALID_ARGUMENT", 502: "INTERNAL"}
    for status, name in codes.items():
        assert grpc_server.status_code(status) == getattr(grpc.StatusCode, name), status
