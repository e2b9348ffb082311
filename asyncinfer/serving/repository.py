"""A Triton-layout model repository, and Triton's model configuration read and written.

Layout (Triton's)::

    DIR/<model>/config.pbtxt            optional
    DIR/<model>/<version>/model.onnx    versions are positive integers; the highest is served

``config.pbtxt`` (protobuf text format, read by `.pbtxt`) may set, for asyncinfer:

=====================================  ===================================================================
``max_batch_size: N``                  0: no batching (requests are whole inputs); N > 0: the model's
                                       inputs share a symbolic first axis, and merged runs hold up to N rows
``dynamic_batching { ... }``           merge concurrent requests; ``max_queue_delay_microseconds``
                                       (default 0) is how long a request may wait for batch-mates;
                                       ``preferred_batch_size`` is ignored
``instance_group [{count, kind}]``     ``count``: engine runs in flight at once; ``kind``: KIND_GPU runs
                                       on ``gpu_compute``, KIND_CPU on ``cpu``, KIND_AUTO (or none) on
                                       the server's ``--backend``
``parameters {key, value}``            ``backend`` (cpu, gpu_compute, gpu_pixel: wins over ``kind``),
                                       ``threads`` (CPU thread-pool size), ``generation`` (``true``: a
                                       decoder for the generation endpoints; ``false``: not one)
``version_policy``                     ``latest {num_versions}`` (default: 1), ``all {}``,
                                       ``specific {versions}``
``default_model_filename``             instead of ``model.onnx``
``name``, ``platform``, ``backend``    checked: the directory's name, ``onnxruntime_onnx``, ``onnxruntime``
``input``, ``output``                  checked against the model: names, ``data_type``, ``dims``
=====================================  ===================================================================

Fields asyncinfer does not use are logged and ignored; fields that would change what a model
computes (``sequence_batching``, ``ensemble_scheduling``, a decoupled transaction policy) are
refused. Without ``config.pbtxt`` a model gets the server's options (``--backend``,
``--max-batch-size``, ``--max-delay-ms``, ``--no-batching``). The same fields in Triton's JSON
form are accepted as the ``config`` of a load request. `triton_config` writes the JSON
form that ``GET /v2/models/{name}/config`` answers.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..backends import BackendType
from ..errors import ModelLoadError
from ..model.ir import Model, TensorInfo
from .batching import batch_symbol
from .pbtxt import Identifier, Message, Value, parse
from .protocol import ProtocolError, datatype_of

CONFIG_FILE = "config.pbtxt"
DEFAULT_MODEL_FILENAME = "model.onnx"
DEFAULT_MAX_BATCH_SIZE = 32  # for a config asking for dynamic batching without a max_batch_size
PLATFORMS = ("onnxruntime_onnx", "onnx")
BACKENDS = ("onnxruntime", "asyncinfer")
KINDS = ("KIND_AUTO", "KIND_CPU", "KIND_GPU", "KIND_MODEL")
REFUSED = {"sequence_batching": "stateful sequence batching", "ensemble_scheduling": "ensembles"}
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSettings:
    """How one model version is served (the server's defaults, or its config's choices).

    ``max_batch_size`` has Triton's meaning: 0 means no batch dimension.
    """

    backend: str = "cpu"
    dynamic_batching: bool = True
    max_batch_size: int = 32
    max_delay: float = 0.002  # seconds
    threads: int | None = None
    instances: int = 2  # engine runs in flight at once (the batcher's max_concurrent_batches)
    warmup: bool = False  # run the model on zeros before it is READY (`ServedModel._warm_up`)
    version_policy: dict[str, Any] = field(default_factory=lambda: {"latest": {"num_versions": 1}})
    parameters: dict[str, str] = field(default_factory=dict)
    model_filename: str = DEFAULT_MODEL_FILENAME


@dataclass(frozen=True)
class TensorConfig:
    """An ``input`` or ``output`` entry of a config: checked against the model."""

    name: str
    data_type: str | None
    dims: tuple[int, ...] | None
    where: str


@dataclass(frozen=True)
class ModelConfig:
    """What a ``config.pbtxt`` (or a load request's JSON config) says; None: not said."""

    source: str = ""
    name: str | None = None
    max_batch_size: int | None = None
    dynamic_batching: bool = False
    max_queue_delay_us: int = 0
    instance_count: int | None = None
    instance_kind: str | None = None
    version_policy: dict[str, Any] | None = None
    default_model_filename: str | None = None
    parameters: dict[str, str] = field(default_factory=dict)
    inputs: tuple[TensorConfig, ...] = ()
    outputs: tuple[TensorConfig, ...] = ()
    max_batch_size_where: str = ""

    def settings(self, defaults: ModelSettings) -> ModelSettings:
        """The settings of a model with this config, the server's ``defaults`` filling the gaps."""
        if self.max_batch_size is not None:
            max_batch_size, dynamic = self.max_batch_size, self.dynamic_batching and self.max_batch_size > 0
        elif self.dynamic_batching:
            max_batch_size, dynamic = defaults.max_batch_size or DEFAULT_MAX_BATCH_SIZE, True
        else:
            max_batch_size, dynamic = defaults.max_batch_size, defaults.dynamic_batching
        max_delay = self.max_queue_delay_us / 1e6 if self.dynamic_batching else defaults.max_delay
        backend = defaults.backend
        if self.instance_kind == "KIND_GPU":
            backend = BackendType.GPU_COMPUTE.value
        elif self.instance_kind == "KIND_CPU":
            backend = BackendType.CPU.value
        backend = self.parameters.get("backend", backend)
        threads = int(self.parameters["threads"]) if "threads" in self.parameters else defaults.threads
        return ModelSettings(backend=backend, dynamic_batching=dynamic, max_batch_size=max_batch_size,
                             max_delay=max_delay, threads=threads, instances=self.instance_count or defaults.instances,
                             version_policy=self.version_policy or defaults.version_policy,
                             parameters=dict(self.parameters), warmup=defaults.warmup,
                             model_filename=self.default_model_filename or DEFAULT_MODEL_FILENAME)


# -- reading a config ---------------------------------------------------------------------------
def read_config_file(path: Path, source: str | None = None) -> ModelConfig:
    """Read a ``config.pbtxt``; ModelLoadError (naming ``source`` and the line) when malformed."""
    source = source or path.name
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{source}: cannot be read ({type(exc).__name__}: {exc})") from None
    return _Interpreter(source, from_json=False).config(parse(text, source))


def config_from_json(config: Any, source: str = "the load request's config") -> ModelConfig:
    """A config in Triton's JSON form (what ``GET .../config`` answers, or a load request sends)."""
    if not isinstance(config, dict):
        raise ModelLoadError(f"{source} must be a JSON object, got {type(config).__name__}")
    return _Interpreter(source, from_json=True).config(_message_of(config, source))


def _message_of(obj: dict[str, Any], source: str, depth: int = 0) -> Message:
    """A JSON object as the text format's generic message (maps of messages become key/value entries)."""
    if depth > 16:
        raise ModelLoadError(f"{source}: nested too deeply")
    message = Message(line=0)
    for key, value in obj.items():
        if key == "parameters" and isinstance(value, dict):  # a protobuf map in JSON: {key: {string_value}}
            for name, entry in value.items():
                message.add(key, Value(_message_of({"key": name, "value": entry}, source, depth + 1), 0))
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict):
                message.add(key, Value(_message_of(item, source, depth + 1), 0))
            elif isinstance(item, bool):
                message.add(key, Value(Identifier("true" if item else "false"), 0))
            elif isinstance(item, (str, int, float)):
                message.add(key, Value(item, 0))
            else:
                raise ModelLoadError(f"{source}: field {key!r} has a value of type {type(item).__name__}")
    return message


class _Interpreter:
    """Gives the generic message its meaning, checking every field's type."""

    def __init__(self, source: str, from_json: bool):
        self.source, self.from_json = source, from_json

    def where(self, value: Value | Message | None) -> str:
        line = value.line if value is not None else 0
        return f"{self.source}, line {line}" if line and not self.from_json else self.source

    def error(self, value: Value | Message | None, message: str) -> ModelLoadError:
        return ModelLoadError(f"{self.where(value)}: {message}")

    def ignore(self, scope: str, name: str, value: Value) -> None:
        logger.info("%s: %s%r is not used by asyncinfer; ignored", self.where(value), scope, name)

    # typed accessors ----------------------------------------------------------------------
    def one(self, message: Message, name: str) -> Value | None:
        values = message.fields.get(name, [])
        if len(values) > 1:
            raise self.error(values[1], f"field {name!r} is given {len(values)} times")
        return values[0] if values else None

    def integer(self, message: Message, name: str, low: int = 0) -> int | None:
        value = self.one(message, name)
        return None if value is None else self.as_int(value, name, low)

    def as_int(self, value: Value, name: str, low: int = 0) -> int:
        raw = value.value
        if self.from_json and isinstance(raw, str) and raw.lstrip("-").isdigit():  # int64 as a JSON string
            raw = int(raw)
        if not isinstance(raw, int) or isinstance(raw, bool):
            raise self.error(value, f"{name!r} must be an integer, got {_show(raw)}")
        if raw < low:
            raise self.error(value, f"{name!r} must be at least {low}, got {raw}")
        return raw

    def string(self, message: Message, name: str) -> str | None:
        value = self.one(message, name)
        if value is None:
            return None
        if not isinstance(value.value, str):
            raise self.error(value, f"{name!r} must be a string, got {_show(value.value)}")
        return value.value

    def enum(self, message: Message, name: str, allowed: tuple[str, ...]) -> str | None:
        value = self.one(message, name)
        if value is None:
            return None
        raw = value.value.name if isinstance(value.value, Identifier) else value.value
        if raw not in allowed:
            raise self.error(value, f"{name!r} must be one of {', '.join(allowed)}, got {_show(raw)}")
        return str(raw)

    def sub(self, message: Message, name: str) -> Message | None:
        value = self.one(message, name)
        if value is None:
            return None
        if not isinstance(value.value, Message):
            raise self.error(value, f"{name!r} must be a message {{ ... }}, got {_show(value.value)}")
        return value.value

    def subs(self, message: Message, name: str) -> list[Message]:
        out = []
        for value in message.fields.get(name, []):
            if not isinstance(value.value, Message):
                raise self.error(value, f"{name!r} must be a message {{ ... }}, got {_show(value.value)}")
            out.append(value.value)
        return out

    def integers(self, message: Message, name: str, low: int) -> list[int]:
        return [self.as_int(v, name, low) for v in message.fields.get(name, [])]

    def unknown(self, message: Message, known: set[str], scope: str = "") -> None:
        for name, values in message.fields.items():
            if name not in known and values:
                self.ignore(scope, name, values[0])

    # the config -----------------------------------------------------------------------------
    def config(self, root: Message) -> ModelConfig:
        for name, what in REFUSED.items():
            if root.fields.get(name):
                raise self.error(root.fields[name][0], f"{name!r}: asyncinfer does not serve {what}")
        policy = self.sub(root, "model_transaction_policy")
        if policy is not None and self.boolean(policy, "decoupled"):
            raise self.error(root.fields["model_transaction_policy"][0],
                             "decoupled models (several responses per request) are not supported")
        platform = self.string(root, "platform")
        if platform is not None and platform not in PLATFORMS:
            raise self.error(self.one(root, "platform"), f"asyncinfer serves ONNX models: platform {platform!r} is "
                                                         f"not supported (use {PLATFORMS[0]!r})")
        backend = self.string(root, "backend")
        if backend is not None and backend not in BACKENDS:
            raise self.error(self.one(root, "backend"), f"backend {backend!r} is not supported (use {BACKENDS[0]!r})")
        max_batch_size = self.integer(root, "max_batch_size")
        dynamic = self.sub(root, "dynamic_batching")
        delay = 0
        if dynamic is not None:
            delay = self.integer(dynamic, "max_queue_delay_microseconds") or 0
            self.unknown(dynamic, {"max_queue_delay_microseconds", "preferred_batch_size"}, "dynamic_batching.")
            self.integers(dynamic, "preferred_batch_size", 1)  # checked, then ignored: batches fill to the max
        count, kind = self.instance_group(root)
        filename = self.string(root, "default_model_filename")
        if filename is not None and (not filename or "/" in filename or "\\" in filename or filename in (".", "..")):
            raise self.error(self.one(root, "default_model_filename"),
                             f"'default_model_filename' must be a file name, got {filename!r}")
        mbs_value = self.one(root, "max_batch_size")
        self.unknown(root, {"name", "platform", "backend", "max_batch_size", "dynamic_batching", "instance_group",
                            "version_policy", "parameters", "default_model_filename", "input", "output",
                            "model_transaction_policy"})
        return ModelConfig(
            source=self.source, name=self.string(root, "name"), max_batch_size=max_batch_size,
            dynamic_batching=dynamic is not None, max_queue_delay_us=delay, instance_count=count, instance_kind=kind,
            version_policy=self.version_policy(root), default_model_filename=filename,
            parameters=self.parameters(root), inputs=self.tensors(root, "input"), outputs=self.tensors(root, "output"),
            max_batch_size_where=self.where(mbs_value))

    def boolean(self, message: Message, name: str) -> bool:
        value = self.one(message, name)
        if value is None:
            return False
        raw = value.value
        if isinstance(raw, Identifier) and raw.name in ("true", "false", "True", "False"):
            return raw.name.lower() == "true"
        if isinstance(raw, int) and raw in (0, 1):
            return bool(raw)
        raise self.error(value, f"{name!r} must be true or false, got {_show(raw)}")

    def instance_group(self, root: Message) -> tuple[int | None, str | None]:
        groups = self.subs(root, "instance_group")
        if not groups:
            return None, None
        count, kinds = 0, set()
        for group in groups:
            count += self.integer(group, "count", 1) or 1
            kinds.add(self.enum(group, "kind", KINDS) or "KIND_AUTO")
            self.unknown(group, {"count", "kind", "name", "gpus"}, "instance_group.")
        if len(kinds) > 1:
            raise self.error(groups[1], f"instance groups of different kinds ({', '.join(sorted(kinds))}) are not "
                                        "supported: a model runs on one backend")
        kind = kinds.pop()
        return count, None if kind in ("KIND_AUTO", "KIND_MODEL") else kind

    def version_policy(self, root: Message) -> dict[str, Any] | None:
        policy = self.sub(root, "version_policy")
        if policy is None:
            return None
        given = [name for name in ("latest", "all", "specific") if policy.fields.get(name)]
        if len(given) != 1 or len(policy.fields) != 1:
            raise self.error(policy, "'version_policy' needs exactly one of latest { num_versions: N }, all { }, "
                                     "specific { versions: [...] }")
        body = self.sub(policy, given[0])
        assert body is not None
        if given[0] == "latest":
            return {"latest": {"num_versions": self.integer(body, "num_versions", 1) or 1}}
        if given[0] == "all":
            return {"all": {}}
        versions = self.integers(body, "versions", 1)
        if not versions:
            raise self.error(body, "'specific' needs at least one version")
        return {"specific": {"versions": sorted(set(versions))}}

    def parameters(self, root: Message) -> dict[str, str]:
        out: dict[str, str] = {}
        for entry in self.subs(root, "parameters"):
            key = self.string(entry, "key")
            value = self.sub(entry, "value")
            if key is None or value is None:
                raise self.error(entry, "each 'parameters' entry needs a key and a value { string_value: ... }")
            text = self.string(value, "string_value")
            if text is None:
                raise self.error(value, f"parameter {key!r} needs a string_value")
            where = self.one(value, "string_value")
            if key == "backend":
                if text not in [b.value for b in BackendType]:
                    raise self.error(where, f"parameter 'backend' must be one of "
                                            f"{', '.join(b.value for b in BackendType)}, got {text!r}")
            elif key == "threads":
                if not text.isdigit() or int(text) < 1:
                    raise self.error(where, f"parameter 'threads' must be a positive integer, got {text!r}")
            elif key == "generation":  # read by .generation
                if text.strip().lower() not in ("true", "false"):
                    raise self.error(where, f"parameter 'generation' must be true or false, got {text!r}")
            else:
                logger.info("%s: parameter %r is not used by asyncinfer; ignored", self.where(where), key)
            out[key] = text
        return out

    def tensors(self, root: Message, kind: str) -> tuple[TensorConfig, ...]:
        out = []
        for entry in self.subs(root, kind):
            name = self.string(entry, "name")
            if name is None:
                raise self.error(entry, f"each {kind!r} needs a name")
            data_type = self.enum(entry, "data_type", TRITON_TYPES)
            dims = tuple(self.integers(entry, "dims", -1)) if "dims" in entry.fields else None
            out.append(TensorConfig(name, data_type, dims, self.where(entry)))
        return tuple(out)


def _show(value: Any) -> str:
    if isinstance(value, Identifier):
        return value.name
    if isinstance(value, Message):
        return "a message"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- checking a config against its model ----------------------------------------------------------
TRITON_TYPES = ("TYPE_BOOL", "TYPE_UINT8", "TYPE_UINT16", "TYPE_UINT32", "TYPE_UINT64", "TYPE_INT8", "TYPE_INT16",
                "TYPE_INT32", "TYPE_INT64", "TYPE_FP16", "TYPE_FP32", "TYPE_FP64", "TYPE_STRING", "TYPE_BF16")


def triton_type(info: TensorInfo) -> str:
    """Triton's ``data_type`` of a model input or output (``TYPE_FP32``…; BYTES is ``TYPE_STRING``)."""
    try:
        datatype = datatype_of(info.dtype)
    except ProtocolError:
        return "TYPE_INVALID"
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def check_config_against_model(config: ModelConfig, model: Model, settings: ModelSettings, what: str) -> None:
    """ModelLoadError when the config's batching, inputs or outputs do not fit the model."""
    if config.max_batch_size and batch_symbol(model) is None:
        inputs = ", ".join(f"{i.name} {list(i.shape) if i.shape is not None else '?'}" for i in model.inputs)
        raise ModelLoadError(f"{config.max_batch_size_where}: max_batch_size {config.max_batch_size} needs a batch "
                             f"dimension (the first axis of every input, the same symbolic dimension), but {what} "
                             f"takes {inputs}; set max_batch_size: 0")
    batched = settings.max_batch_size > 0 and batch_symbol(model) is not None
    for entries, infos, kind in ((config.inputs, model.inputs, "input"), (config.outputs, model.outputs, "output")):
        declared = {i.name: i for i in infos}
        for entry in entries:
            info = declared.get(entry.name)
            if info is None:
                raise ModelLoadError(f"{entry.where}: {kind} {entry.name!r} is not an {kind} of {what} "
                                     f"(it has {list(declared)})")
            if entry.data_type is not None and entry.data_type != triton_type(info):
                raise ModelLoadError(f"{entry.where}: {kind} {entry.name!r} is {triton_type(info)} in {what}, "
                                     f"the config says {entry.data_type}")
            if entry.dims is not None and info.shape is not None:
                want = config_dims(info, batched)
                if len(entry.dims) != len(want) or any(c != -1 and m != -1 and c != m
                                                       for c, m in zip(entry.dims, want)):
                    raise ModelLoadError(f"{entry.where}: {kind} {entry.name!r} has dims {list(want)} in {what}"
                                         f"{' (without the batch dimension)' if batched else ''}, the config says "
                                         f"{list(entry.dims)}")


def config_dims(info: TensorInfo, batched: bool) -> list[int]:
    """Triton's ``dims``: -1 for a symbolic dimension, without the batch axis when batched."""
    if info.shape is None:
        return [-1]
    dims = [d if isinstance(d, int) else -1 for d in info.shape]
    return dims[1:] if batched else dims


# -- the JSON config --------------------------------------------------------------------------------
def triton_config(name: str, model: Model, settings: ModelSettings, max_batch_size: int) -> dict[str, Any]:
    """The model's configuration in Triton's JSON form (``max_batch_size`` as served: 0 when the
    model has no batch dimension or batching is off)."""
    batched = max_batch_size > 0
    gpu = settings.backend != BackendType.CPU.value
    config: dict[str, Any] = {
        "name": name,
        "platform": PLATFORMS[0],
        "backend": BACKENDS[0],
        "runtime": "",
        "version_policy": settings.version_policy,
        "max_batch_size": max_batch_size,
        "input": [{"name": i.name, "data_type": triton_type(i), "format": "FORMAT_NONE",
                   "dims": config_dims(i, batched), "is_shape_tensor": False, "allow_ragged_batch": False,
                   "optional": i.name in model.input_defaults} for i in model.inputs],
        "output": [{"name": o.name, "data_type": triton_type(o), "dims": config_dims(o, batched), "label_filename": "",
                    "is_shape_tensor": False} for o in model.outputs],
        "batch_input": [],
        "batch_output": [],
        "instance_group": [{"name": f"{name}_0", "kind": "KIND_GPU" if gpu else "KIND_CPU",
                            "count": settings.instances, "gpus": [0] if gpu else [], "secondary_devices": [],
                            "profile": [], "passive": False, "host_policy": ""}],
        "default_model_filename": settings.model_filename,
        "cc_model_filenames": {},
        "metric_tags": {},
        "parameters": {key: {"string_value": value} for key, value in settings.parameters.items()},
        "model_warmup": [],
    }
    if batched and settings.dynamic_batching:
        config["dynamic_batching"] = {"preferred_batch_size": [],
                                      "max_queue_delay_microseconds": round(settings.max_delay * 1e6),
                                      "preserve_ordering": False, "priority_levels": 0, "default_priority_level": 0,
                                      "priority_queue_policy": {}}
    return config


# -- the repository -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RepositoryModel:
    """A model as read from the repository: its config, its settings, the versions to serve."""

    name: str
    config: ModelConfig
    settings: ModelSettings
    versions: dict[str, Path]  # version -> model file, as the version policy selects them


class Repository:
    """A Triton-layout model repository on disk. Its methods do file I/O: call them from a worker thread."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)

    def names(self) -> list[str]:
        """The model directories (hidden ones skipped), sorted."""
        try:
            return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError as exc:
            logger.error("the model repository cannot be listed: %s", exc)
            return []

    def has(self, name: str) -> bool:
        """Whether ``name`` is a model directory of the repository (an untrusted name: no paths)."""
        if not isinstance(name, str) or not name or name.startswith(".") or "/" in name or "\\" in name:
            return False
        return (self.root / name).is_dir()

    def read(self, name: str, config_json: Mapping[str, Any] | None, defaults: ModelSettings) -> RepositoryModel:
        """Read model ``name``: its config (``config_json`` replaces ``config.pbtxt``), and the
        versions its version policy selects. ModelLoadError when the config is bad or there is
        no version to serve."""
        directory = self.root / name
        config_path = directory / CONFIG_FILE
        if config_json is not None:
            config = config_from_json(dict(config_json))
        elif config_path.is_file():
            config = read_config_file(config_path, f"{name}/{CONFIG_FILE}")
        else:
            config = ModelConfig()
        if config.name is not None and config.name != name:
            raise ModelLoadError(f"{config.source or name}: the config names the model {config.name!r}, "
                                 f"but its directory is {name!r}")
        settings = config.settings(defaults)
        available = self.versions(name)
        if not available:
            raise ModelLoadError(f"model {name!r} has no version directory (expected "
                                 f"{name}/<version>/{settings.model_filename}, the version a positive integer)")
        chosen = _select(available, settings.version_policy, name)
        return RepositoryModel(name, config, settings,
                               {str(v): directory / str(v) / settings.model_filename for v in chosen})

    def versions(self, name: str) -> list[int]:
        """The version directories of ``name``, as integers, sorted."""
        try:
            entries = list((self.root / name).iterdir())
        except OSError:
            return []
        return sorted(int(p.name) for p in entries if p.is_dir() and p.name.isdigit() and int(p.name) > 0)

    def fingerprint(self, name: str) -> object:
        """What changes when a model's files change (names, sizes, modification times): poll mode
        reloads a model whose fingerprint moved."""
        directory = self.root / name
        found = []
        try:
            for path in sorted(directory.rglob("*")):
                if path.is_file():
                    stat = path.stat()
                    found.append((str(path.relative_to(directory)), stat.st_size, stat.st_mtime_ns))
        except OSError:
            pass
        return tuple(found)


def _select(available: list[int], policy: Mapping[str, Any], name: str) -> list[int]:
    if "all" in policy:
        return available
    if "specific" in policy:
        wanted = policy["specific"]["versions"]
        missing = [v for v in wanted if v not in available]
        if missing:
            raise ModelLoadError(f"model {name!r}: version_policy asks for version(s) {missing}, the repository has "
                                 f"{available}")
        return list(wanted)
    return available[-policy["latest"]["num_versions"]:]
