"""The load test's baseline server: ONNX Runtime behind a plain FastAPI handler, speaking KServe v2.

    python3 -m bench.serving_baseline NAME=MODEL.onnx [NAME=OTHER.onnx ...] [--port 8000] [--threads N]

What a user would write to serve a model from asyncio without an inference server: one
``onnxruntime.InferenceSession`` per model (intra-op threads = ``--threads``, default the core
count), an ``async`` FastAPI handler that decodes the request, runs
``await loop.run_in_executor(None, session.run, None, feed)`` on the default executor and answers.
No batching, no queue limit.

It speaks enough of the Open Inference Protocol (KServe v2) for ``bench/serving_load.py`` and
perf_analyzer: ``GET /v2/health/live|ready``, ``GET /v2`` and ``GET /v2/models/{name}`` (metadata),
``GET /v2/models/{name}/config`` (a Triton-style config: perf_analyzer reads it) and
``POST /v2/models/{name}/infer`` with JSON tensors or the binary tensor data extension, both ways.
A request it cannot decode gets a 400 with ``{"error": ...}``.

The wire helpers at the top (datatypes, :func:`encode_request`, :func:`decode_response`) are the
client's side of the same format; ``bench/serving_load.py`` uses them.
"""
# No `from __future__ import annotations`: FastAPI reads the handlers' annotations as objects.

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# -- the wire format (both sides) -------------------------------------------------------------------
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64), "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
}
DATATYPE_OF: dict[np.dtype, str] = {dtype: name for name, dtype in DATATYPES.items()}
# ONNX Runtime's type strings, for metadata ("tensor(float)" -> "FP32").
ORT_TYPES: dict[str, str] = {
    "tensor(bool)": "BOOL", "tensor(uint8)": "UINT8", "tensor(uint16)": "UINT16", "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64", "tensor(int8)": "INT8", "tensor(int16)": "INT16", "tensor(int32)": "INT32",
    "tensor(int64)": "INT64", "tensor(float16)": "FP16", "tensor(float)": "FP32", "tensor(double)": "FP64",
}
HEADER_LENGTH = "Inference-Header-Content-Length"


class BadRequest(ValueError):
    """A request the server cannot decode; the message says what is wrong."""


def encode_request(inputs: Mapping[str, np.ndarray], *, binary_outputs: bool = True) -> tuple[bytes, dict[str, str]]:
    """An infer request body with every input as binary tensor data, and its extra HTTP headers."""
    arrays = {name: np.ascontiguousarray(a) for name, a in inputs.items()}
    header = {"inputs": [{"name": name, "shape": list(a.shape), "datatype": DATATYPE_OF[a.dtype],
                          "parameters": {"binary_data_size": a.nbytes}} for name, a in arrays.items()],
              "parameters": {"binary_data_output": binary_outputs}}
    head = json.dumps(header, separators=(",", ":")).encode()
    body = b"".join([head, *(a.tobytes() for a in arrays.values())])
    return body, {HEADER_LENGTH: str(len(head)), "Content-Type": "application/octet-stream"}


def split_body(body: bytes, header_length: str | None) -> tuple[dict[str, Any], memoryview]:
    """The JSON header of a request or response body and the binary data that follows it."""
    length = len(body)
    if header_length is not None:
        try:
            length = int(header_length)
        except ValueError:
            raise BadRequest(f"{HEADER_LENGTH} must be an integer, got {header_length!r}") from None
        if not 0 <= length <= len(body):
            raise BadRequest(f"{HEADER_LENGTH} is {length}, but the body has {len(body)} bytes")
    try:
        header = json.loads(body[:length])
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise BadRequest("the body must be a JSON object")
    return header, memoryview(body)[length:]


def decode_tensors(entries: Any, binary: memoryview, what: str) -> dict[str, np.ndarray]:
    """The tensors of a request's ``inputs`` or a response's ``outputs``: ``data`` or binary chunks."""
    if not isinstance(entries, list):
        raise BadRequest(f"'{what}' must be a list")
    tensors, offset = {}, 0
    for entry in entries:
        try:
            name, shape, dtype = entry["name"], [int(d) for d in entry["shape"]], DATATYPES[entry["datatype"]]
        except (KeyError, TypeError, ValueError):
            raise BadRequest(f"each of '{what}' needs a name, an integer shape and a known datatype "
                             f"({', '.join(DATATYPES)}): got {str(entry)[:200]}") from None
        size = (entry.get("parameters") or {}).get("binary_data_size")
        try:
            if size is not None:
                chunk = binary[offset:offset + int(size)]
                if len(chunk) != int(size):
                    raise BadRequest(f"{name!r}: 'binary_data_size' is {size}, only {len(chunk)} bytes are left")
                offset += int(size)
                array = np.frombuffer(chunk, dtype=dtype).reshape(shape)
            else:
                array = np.asarray(entry["data"], dtype=dtype).reshape(shape)
        except (KeyError, TypeError, ValueError) as exc:
            raise BadRequest(f"{name!r}: cannot build a {entry['datatype']} tensor of shape {shape}: {exc}") from None
        tensors[name] = array
    return tensors


def decode_response(body: bytes, header_length: str | None) -> dict[str, np.ndarray]:
    """The output tensors of an infer response (JSON or binary)."""
    header, binary = split_body(body, header_length)
    return decode_tensors(header.get("outputs"), binary, "outputs")


# -- the server -------------------------------------------------------------------------------------
def _session(path: str, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def _dims(shape: Sequence[Any]) -> list[int]:
    return [d if isinstance(d, int) and d > 0 else -1 for d in shape]


def _tensor_meta(args: Sequence[Any]) -> list[dict[str, Any]]:
    return [{"name": a.name, "datatype": ORT_TYPES.get(a.type, a.type), "shape": _dims(a.shape)} for a in args]


def metadata(name: str, session: Any) -> dict[str, Any]:
    """KServe v2 model metadata."""
    return {"name": name, "versions": ["1"], "platform": "onnxruntime_onnx",
            "inputs": _tensor_meta(session.get_inputs()), "outputs": _tensor_meta(session.get_outputs())}


def config(name: str, session: Any) -> dict[str, Any]:
    """A Triton-style model config: no batch dimension of its own (max_batch_size 0), full dims."""
    def tensors(args: Sequence[Any]) -> list[dict[str, Any]]:
        return [{"name": a.name, "data_type": "TYPE_" + ORT_TYPES.get(a.type, "FP32"),
                 "dims": _dims(a.shape)} for a in args]

    return {"name": name, "platform": "onnxruntime_onnx", "backend": "onnxruntime", "max_batch_size": 0,
            "input": tensors(session.get_inputs()), "output": tensors(session.get_outputs())}


def encode_response(name: str, header: Mapping[str, Any], names: Sequence[str],
                    outputs: Sequence[np.ndarray]) -> tuple[bytes, dict[str, str]]:
    """The response body (JSON, or binary where the request asked for it) and its headers."""
    default_binary = bool((header.get("parameters") or {}).get("binary_data_output", False))
    wanted = {o["name"]: bool((o.get("parameters") or {}).get("binary_data", default_binary))
              for o in header.get("outputs") or [] if isinstance(o, dict) and "name" in o}
    entries, chunks = [], []
    for out_name, array in zip(names, outputs):
        if wanted and out_name not in wanted:
            continue
        array = np.ascontiguousarray(array)
        entry: dict[str, Any] = {"name": out_name, "datatype": DATATYPE_OF[array.dtype], "shape": list(array.shape)}
        if wanted.get(out_name, default_binary):
            entry["parameters"] = {"binary_data_size": array.nbytes}
            chunks.append(array.tobytes())
        else:
            entry["data"] = array.ravel().tolist()
        entries.append(entry)
    answer: dict[str, Any] = {"model_name": name, "model_version": "1", "outputs": entries}
    if "id" in header:
        answer["id"] = header["id"]
    head = json.dumps(answer, separators=(",", ":")).encode()
    if not chunks:
        return head, {"Content-Type": "application/json"}
    return b"".join([head, *chunks]), {HEADER_LENGTH: str(len(head)), "Content-Type": "application/octet-stream"}


def build_app(sessions: Mapping[str, Any]) -> Any:
    """The FastAPI app serving ``sessions`` (model name -> InferenceSession)."""
    from fastapi import FastAPI, Request, Response
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.get("/v2/health/live")
    @app.get("/v2/health/ready")
    async def health() -> dict[str, bool]:
        return {"live": True, "ready": True}

    def unknown_model(name: str) -> Response:
        return JSONResponse({"error": f"no model named {name!r}"}, status_code=404)

    @app.get("/v2")
    async def server_metadata() -> dict[str, Any]:
        return {"name": "onnxruntime-fastapi-baseline", "version": "1", "extensions": ["binary_tensor_data"]}

    @app.get("/v2/models/{name}")
    async def model_metadata(name: str) -> Response:
        if (session := sessions.get(name)) is None:
            return unknown_model(name)
        return JSONResponse(metadata(name, session))

    @app.get("/v2/models/{name}/config")
    async def model_config(name: str) -> Response:
        if (session := sessions.get(name)) is None:
            return unknown_model(name)
        return JSONResponse(config(name, session))

    @app.post("/v2/models/{name}/infer")
    async def infer(name: str, request: Request) -> Response:
        if (session := sessions.get(name)) is None:
            return unknown_model(name)
        body = await request.body()
        try:
            header, binary = split_body(body, request.headers.get(HEADER_LENGTH))
            feed = decode_tensors(header.get("inputs"), binary, "inputs")
        except BadRequest as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        names = [o.name for o in session.get_outputs()]
        loop = asyncio.get_running_loop()
        try:
            outputs = await loop.run_in_executor(None, session.run, names, feed)
        except Exception as exc:  # noqa: BLE001 - ORT's errors (wrong input name, shape...) are the caller's
            return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=400)
        content, headers = encode_response(name, header, names, outputs)
        return Response(content, headers=headers)

    return app


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python3 -m bench.serving_baseline", description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+", metavar="NAME=PATH", help="ONNX models and the names to serve them under")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--threads", type=int, default=None, help="ORT intra-op threads (default: cores)")
    args = parser.parse_args(argv)
    pairs = {}
    for spec in args.models:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = Path(spec).stem, spec
        if not Path(path).is_file():
            parser.error(f"{path}: no such file")
        pairs[name] = path
    args.models = pairs
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import uvicorn

    threads = args.threads or max(1, os.cpu_count() or 1)
    sessions = {name: _session(path, threads) for name, path in args.models.items()}
    # No access log: asyncinfer serve runs with --log-level warning in the load test too.
    uvicorn.run(build_app(sessions), host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
