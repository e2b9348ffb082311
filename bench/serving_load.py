"""Serving load test: `asyncinfer serve` against ONNX Runtime behind a plain FastAPI handler, over HTTP.

Servers, each its own process(es) on a free local port, serving the same models:

- ``asyncinfer``: ``python -m asyncinfer serve`` with dynamic batching (its default options);
- ``asyncinfer_w2`` (``--workers 2``, the default where there are 2 cores or more): the same with
  ``--workers 2``, two server processes behind one port, each with half the CPU threads;
- ``asyncinfer_unbatched``: the same as ``asyncinfer`` with ``--no-batching``;
- ``baseline``: ``bench/serving_baseline.py``, one ``onnxruntime.InferenceSession`` per model
  behind an async FastAPI/uvicorn handler calling ``await loop.run_in_executor(None, session.run,
  ...)``: what a user would write.

All speak the Open Inference Protocol (KServe v2). Before anything is timed, every server answers
the same request (binary tensor data, then JSON) and their outputs must agree with the baseline's.
Then, per model and concurrency level (1, 4, 8, 16 in-flight requests), the servers take turns
(the order rotating): an untimed warm-up, then a timed block of batch-1 requests with binary
tensor data. The client is perf_analyzer (Triton's load generator) when it is installed and runs
against every server (``$PERF_ANALYZER`` or ``PATH``; ``bench/install_perf_analyzer.sh`` installs
it), else a bounded local client: one asyncio task per in-flight request, each on its own
keep-alive connection (raw asyncio streams: a few tens of µs of client CPU per request). Either
way the client runs on the same cores as the servers; the report gives its CPU use.

Reported per model, level and server: throughput (infer/s), p50/p99 latency, errors, the ratio to
the baseline, the client's and the server's CPU use (cores; a server with workers: all its
processes), and for asyncinfer the requests each engine run carried (from the server's statistics
endpoint, where it has one). The issue's floor (concurrency 8) is read from the multi-worker
server where it was measured (`floor_kind`), else from ``asyncinfer``.

    python3 bench/serving_load.py [--models digits squeezenet] [--levels 1 4 8 16] [--seconds 5] \
        [--rounds 2] [--warmup 1] [--client auto|local|perf_analyzer] [--threads N] [--workers N] \
        [--no-write]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and the checkout's asyncinfer importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import onnx

from asyncinfer import assets
from bench import common
from bench.serving_baseline import DATATYPE_OF, HEADER_LENGTH, decode_response, encode_request

SERVERS: dict[str, str] = {
    "asyncinfer": "asyncinfer serve, dynamic batching (default options)",
    "asyncinfer_unbatched": "asyncinfer serve --no-batching",
    "baseline": "ONNX Runtime behind FastAPI/uvicorn, session.run in the default executor",
}
BASELINE = "baseline"
WORKERS_KIND = "asyncinfer_w{}"  # asyncinfer serve --workers N
LEVELS: tuple[int, ...] = (1, 4, 8, 16)
CLIENTS = ("auto", "local", "perf_analyzer")
HOST = "127.0.0.1"

READY_TIMEOUT_S = 120.0  # a loaded 2-core machine can take a while to import and load everything
STOP_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 30.0  # one request of the local client; past it the request counts as an error
SETTLE_S = 0.1  # pause before each block: ORT's spinning pool threads settle down

# Recorded with the results: OpenBLAS's own threads move asyncinfer's figures a lot (bench/README.md).
BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")

# A server process gets SIGTERM when the bench process dies, however it dies (Linux: a parent-death
# signal, kept across exec), so no server outlives a killed bench. Elsewhere only the normal cleanup.
_DIE_WITH_PARENT = """\
import ctypes, os, signal, sys
if sys.platform.startswith("linux"):
    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    if os.getppid() != int(sys.argv[1]):
        sys.exit(1)  # the bench died before the signal was armed
os.execv(sys.argv[2], sys.argv[2:])
"""


# -- models -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """A model to serve: its file, one batch-1 request, and whether its batch dimension is free."""

    name: str
    path: Path
    inputs: dict[str, np.ndarray]
    batchable: bool


def model_spec(name: str) -> ModelSpec:
    """The embedded digits CNN (``digits``) or a model of onnx's light model zoo, with its input."""
    if name == "digits":
        path = assets.default_model_path()
        proto = onnx.load(str(path))
        inputs = {common.graph_inputs(proto)[0].name: assets.default_samples()[0][:1]}
    else:
        path = common.light_model_path(name)
        proto = onnx.load(str(path))
        inputs = common.standard_inputs(proto, batch=1)
    first_dims = [vi.type.tensor_type.shape.dim[0] for vi in common.graph_inputs(proto)]
    batchable = all(not d.HasField("dim_value") or d.dim_value <= 0 for d in first_dims)
    return ModelSpec(name, path, inputs, batchable)


# -- server processes -------------------------------------------------------------------------------
class ServerError(RuntimeError):
    """A server process did not start, or died."""


def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def http(method: str, url: str, body: bytes | None = None, headers: Mapping[str, str] | None = None,
         timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, dict[str, str], bytes]:
    """One blocking HTTP request: (status, lower-cased headers, body); HTTP errors are answers too."""
    request = urllib.request.Request(url, data=body, method=method, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, {k.lower(): v for k, v in answer.headers.items()}, answer.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


def kinds_for(workers: int) -> list[str]:
    """The servers a run measures: ``asyncinfer``, ``asyncinfer_w<workers>`` when ``workers`` > 1,
    ``asyncinfer_unbatched`` and the baseline."""
    kinds = ["asyncinfer", *([WORKERS_KIND.format(workers)] if workers > 1 else []), "asyncinfer_unbatched", BASELINE]
    return kinds


def workers_of(kind: str) -> int:
    """N of ``asyncinfer_wN`` (1 for any other server)."""
    prefix = WORKERS_KIND.format("")
    return int(kind[len(prefix):]) if kind.startswith(prefix) and kind[len(prefix):].isdigit() else 1


def describe_server(kind: str) -> str:
    workers = workers_of(kind)
    return f"asyncinfer serve --workers {workers}, dynamic batching" if workers > 1 else SERVERS[kind]


def floor_kind(row: Mapping[str, Any]) -> str:
    """Which server the issue's floor is read from in one level's ``row``: the multi-worker one
    when measured (what ``serve --workers auto`` runs on this machine), else ``asyncinfer``."""
    multi = [kind for kind in row if workers_of(kind) > 1]
    return multi[0] if multi else "asyncinfer"


def server_argv(kind: str, models: Mapping[str, Path], port: int, threads: int) -> list[str]:
    """The command line that starts server ``kind`` on ``port``."""
    specs = [f"{name}={path}" for name, path in models.items()]
    if kind == BASELINE:
        return [sys.executable, "-m", "bench.serving_baseline", *specs, "--host", HOST, "--port", str(port),
                "--threads", str(threads)]
    workers = workers_of(kind)
    # Warnings only: an access log line per request would cost asyncinfer what the baseline does not pay.
    argv = [sys.executable, "-m", "asyncinfer", "serve", *specs, "--host", HOST, "--port", str(port),
            "--threads", str(max(1, threads // workers)), "--log-level", "warning"]
    if workers > 1:
        argv += ["--workers", str(workers)]
    return argv + (["--no-batching"] if kind == "asyncinfer_unbatched" else [])


@dataclass
class Server:
    """One server process: started by :meth:`start`, stopped (always) by :meth:`stop`."""

    kind: str
    argv_for_port: Any  # port -> argv
    port: int = 0
    proc: subprocess.Popen | None = None
    log: Any = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        self.port = free_port()
        self.log = tempfile.TemporaryFile()  # a file, not a pipe: a full pipe would stall the server
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(common.REPO_ROOT),
                                                                          os.environ.get("PYTHONPATH")]))}
        argv = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *self.argv_for_port(self.port)]
        # Its own session: a Ctrl-C in the terminal reaches the bench only, which then stops it.
        self.proc = subprocess.Popen(argv, cwd=common.REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self, chars: int = 1500) -> str:
        if self.log is None:
            return ""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-chars:].strip()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Poll ``GET /v2/health/ready`` until it answers 200; raise ServerError if the process exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise ServerError(f"{self.kind} server exited with status {self.proc and self.proc.returncode} "
                                  f"before it was ready:\n{self.log_tail()}")
            try:
                if http("GET", f"{self.url}/v2/health/ready", timeout=2)[0] == 200:
                    return
            except OSError:
                pass  # not listening yet
            time.sleep(0.1)
        raise ServerError(f"{self.kind} server not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def cpu_seconds(self) -> float | None:
        """User + system CPU time so far of the server process and its children, the worker
        processes of ``--workers N`` (Linux), else None."""
        try:
            pid = self.proc.pid
            total = _cpu_ticks(pid)
            for stat in Path("/proc").glob("[0-9]*/stat"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    fields = stat.read_text().rpartition(")")[2].split()
                    if int(fields[1]) == pid:  # a child (ppid), e.g. a worker
                        total += int(fields[11]) + int(fields[12])
            return total / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError, AttributeError):
            return None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to its process group (the server and anything it started), if it still runs."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        """SIGTERM (a graceful shutdown), then SIGKILL if it has not exited within STOP_TIMEOUT_S."""
        if self.proc is not None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(STOP_TIMEOUT_S)
        if self.log is not None:
            self.log.close()
            self.log = None


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


def stop_all(servers: Sequence[Server]) -> None:
    """Stop every server: all are told at once, so their shutdowns overlap."""
    for server in servers:
        server.signal(signal.SIGTERM)
    for server in servers:
        server.stop()


@contextlib.contextmanager
def running_servers(models: Mapping[str, Path], threads: int, kinds: Sequence[str] = tuple(SERVERS),
                    verbose: bool = True) -> Iterator[dict[str, Server]]:
    """Start every server (all at once, then wait for each), yield them, stop them whatever happens."""
    with contextlib.ExitStack() as stack:
        servers = {kind: Server(kind, lambda port, kind=kind: server_argv(kind, models, port, threads))
                   for kind in kinds}
        stack.callback(stop_all, list(servers.values()))  # before any start: stopped even if starting fails
        for server in servers.values():  # all at once: they load their models in parallel
            server.start()
        for server in servers.values():
            for attempt in range(3):  # another process may take the port between free_port() and bind
                try:
                    server.wait_ready()
                    break
                except ServerError as exc:
                    if attempt == 2 or "already in use" not in str(exc):
                        raise
                    server.stop()
                    server.start()
        if verbose:
            print("servers: " + ", ".join(f"{k} on :{s.port}" for k, s in servers.items()), flush=True)
        yield servers


# -- correctness ------------------------------------------------------------------------------------
def infer_once(server: Server, model: str, inputs: Mapping[str, np.ndarray], *, binary: bool) -> dict[str, np.ndarray]:
    """One request: binary tensor data both ways, or JSON both ways; the decoded outputs."""
    if binary:
        body, headers = encode_request(inputs)
    else:
        body = json.dumps({"inputs": [{"name": n, "shape": list(a.shape), "datatype": DATATYPE_OF[a.dtype],
                                       "data": a.ravel().tolist()} for n, a in inputs.items()]}).encode()
        headers = {"Content-Type": "application/json"}
    status, answer_headers, answer = http("POST", f"{server.url}/v2/models/{model}/infer", body, headers)
    if status != 200:
        raise common.OutputMismatch(f"{server.kind} answered {status}: {answer[:300].decode(errors='replace')}")
    return decode_response(answer, answer_headers.get(HEADER_LENGTH.lower()))


def check_agreement(servers: Mapping[str, Server], spec: ModelSpec) -> dict[str, Any]:
    """Every server's outputs, binary and JSON, against the baseline's binary answer; raises
    OutputMismatch on a disagreement. Returns the max abs difference per server and encoding."""
    expected = infer_once(servers[BASELINE], spec.name, spec.inputs, binary=True)
    diffs: dict[str, float] = {}
    for kind, server in servers.items():
        for binary in (True, False):
            label = f"{kind} {'binary' if binary else 'json'}"
            try:
                diffs[label] = common.check_outputs_match(infer_once(server, spec.name, spec.inputs, binary=binary),
                                                          expected)
            except common.OutputMismatch as exc:
                raise common.OutputMismatch(f"{label}: {exc}") from None
    return {"ok": True, "max_abs_diff": diffs}


def model_statistics(server: Server, model: str) -> tuple[int, int] | None:
    """(inference count, execution count) from the server's statistics endpoint, or None without one."""
    with contextlib.suppress(OSError, ValueError, KeyError, IndexError, TypeError):
        status, _, body = http("GET", f"{server.url}/v2/models/{model}/stats", timeout=5)
        if status == 200:
            stats = json.loads(body)["model_stats"][0]
            return int(stats["inference_count"]), int(stats["execution_count"])
    return None


# -- the local client -------------------------------------------------------------------------------
class Connection:
    """One keep-alive HTTP/1.1 connection sending the same prepared request again and again."""

    def __init__(self, port: int, request: bytes):
        self.port, self.request = port, request
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(HOST, self.port)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None

    async def send(self) -> int:
        """Send the request, read the whole answer; its HTTP status."""
        if self.writer is None:
            await self.open()
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
        if "content-length" in headers:
            await self.reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding") == "chunked":
            while size := int((await self.reader.readuntil(b"\r\n")).strip(), 16):
                await self.reader.readexactly(size + 2)
            await self.reader.readuntil(b"\r\n")
        if headers.get("connection") == "close":
            self.close()
        return status


def raw_request(port: int, model: str, inputs: Mapping[str, np.ndarray]) -> bytes:
    """The bytes of one binary-tensor infer request, headers included."""
    body, headers = encode_request(inputs)
    head = [f"POST /v2/models/{model}/infer HTTP/1.1", f"Host: {HOST}:{port}", f"Content-Length: {len(body)}",
            *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


@dataclass
class BlockResult:
    """What one timed block measured; ``latencies`` (seconds) only from the local client."""

    client: str
    elapsed_s: float
    ok: int
    errors: int
    latencies: list[float] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)  # perf_analyzer's own throughput and percentiles
    error_samples: list[str] = field(default_factory=list)
    client_cpu_s: float | None = None
    server_cpu_s: float | None = None
    stats: tuple[int, int] | None = None  # (inferences, executions) during the block


async def drive(conns: Sequence[Connection], seconds: float) -> BlockResult:
    """Every connection sends a request, then the next once it is answered, until ``seconds`` are over;
    the requests started before then all finish and count."""
    result = BlockResult("local", 0.0, 0, 0)
    start = time.perf_counter()
    deadline = start + seconds
    last_end = start

    async def loop(conn: Connection) -> None:
        nonlocal last_end
        while time.perf_counter() < deadline:
            t0, reason = time.perf_counter(), ""
            try:
                status = await asyncio.wait_for(conn.send(), REQUEST_TIMEOUT_S)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
                status, reason = None, common.error_text(exc, 120)
                conn.close()  # the next send reconnects
            t1 = time.perf_counter()
            last_end = max(last_end, t1)
            if status == 200:
                result.ok += 1
                result.latencies.append(t1 - t0)
            else:
                result.errors += 1
                if len(result.error_samples) < 3:
                    result.error_samples.append(reason if status is None else f"HTTP {status}")

    await asyncio.gather(*(loop(conn) for conn in conns))
    result.elapsed_s = last_end - start
    return result


async def local_block(server: Server, spec: ModelSpec, concurrency: int, seconds: float,
                      warmup_s: float) -> BlockResult:
    """A pause and a warm-up, then (``seconds`` > 0) a timed block of the local client at
    ``concurrency`` requests in flight."""
    request = raw_request(server.port, spec.name, spec.inputs)
    conns = [Connection(server.port, request) for _ in range(concurrency)]
    try:
        await asyncio.sleep(SETTLE_S)
        result = await drive(conns, warmup_s)
        if seconds > 0:
            stats0, srv0, cpu0 = model_statistics(server, spec.name), server.cpu_seconds(), time.process_time()
            result = await drive(conns, seconds)
            result.client_cpu_s = time.process_time() - cpu0
            result.server_cpu_s = _delta(server.cpu_seconds(), srv0)
            result.stats = _stats_delta(model_statistics(server, spec.name), stats0)
        return result
    finally:
        for conn in conns:
            conn.close()


def _delta(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before


def _stats_delta(after: tuple[int, int] | None, before: tuple[int, int] | None) -> tuple[int, int] | None:
    return None if after is None or before is None else (after[0] - before[0], after[1] - before[1])


# -- perf_analyzer ----------------------------------------------------------------------------------
def find_perf_analyzer() -> str | None:
    """``$PERF_ANALYZER`` when set, else ``perf_analyzer`` on PATH, else None."""
    return os.environ.get("PERF_ANALYZER") or shutil.which("perf_analyzer")


def perf_analyzer_problem(path: str | None) -> str | None:
    """Why perf_analyzer cannot be used (not found, does not start), or None when it starts."""
    if path is None:
        return "perf_analyzer not found ($PERF_ANALYZER unset, none on PATH; see bench/install_perf_analyzer.sh)"
    try:
        proc = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"perf_analyzer ({path}) does not start: {common.error_text(exc)}"
    if "--concurrency-range" not in proc.stdout + proc.stderr:
        return f"perf_analyzer ({path}) does not start: {(proc.stderr or proc.stdout).strip()[-300:]}"
    return None


def shape_args(server: Server, spec: ModelSpec) -> list[str]:
    """``--shape name:dims`` for every input whose configured dims are not all fixed (perf_analyzer
    needs them); the batch dimension is left out where the config has one (max_batch_size > 0)."""
    status, _, body = http("GET", f"{server.url}/v2/models/{spec.name}/config", timeout=10)
    if status != 200:
        return []  # perf_analyzer will say what it misses
    config = json.loads(body)
    batched = int(config.get("max_batch_size", 0)) > 0
    args = []
    for entry in config.get("input", []):
        if any(int(d) < 0 for d in entry.get("dims", [])) and entry["name"] in spec.inputs:
            dims = spec.inputs[entry["name"]].shape[1:] if batched else spec.inputs[entry["name"]].shape
            args += ["--shape", f"{entry['name']}:{','.join(map(str, dims))}"]
    return args


def perf_analyzer_block(path: str, server: Server, spec: ModelSpec, concurrency: int, seconds: float,
                        probe: bool = False, latency_s: float = 0.0) -> BlockResult:
    """perf_analyzer at one concurrency over HTTP: three measurement windows filling ``seconds``
    (stability not required: the windows are short and the machine noisy), each at least 5 times
    ``latency_s`` (the slowest warm-up request: a window in which no request ends is an error to
    perf_analyzer); or with ``probe`` a handful of requests, to see whether it runs at all."""
    with tempfile.TemporaryDirectory() as tmp:
        csv_path = Path(tmp) / "pa.csv"
        argv = [path, "-m", spec.name, "-u", f"{HOST}:{server.port}", "-i", "http",
                "--concurrency-range", f"{concurrency}:{concurrency}", "-f", str(csv_path),
                *shape_args(server, spec)]
        window_ms = 0
        if probe:
            argv += ["--request-count", "8"]
        else:
            window_ms = max(100, int(seconds * 1000 / 3), int(latency_s * 5000))
            argv += ["--measurement-interval", str(window_ms), "--max-trials", "3", "--stability-percentage", "1000"]
        stats0, srv0 = model_statistics(server, spec.name), server.cpu_seconds()
        usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp, timeout=120 + 12 * window_ms / 1000)
        elapsed = time.perf_counter() - start
        usage1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0 or not csv_path.is_file():
            output = (proc.stdout + proc.stderr).strip()
            raise ServerError(f"perf_analyzer failed against {server.kind} (status {proc.returncode}): "
                              f"{' '.join(output.split())[-400:]}")
        with csv_path.open() as f:
            row = next(csv.DictReader(f))
    rate = float(row["Inferences/Second"])
    result = BlockResult("perf_analyzer", elapsed, ok=0, errors=0,
                         figures={"infer_per_s": rate, "p50_ms": float(row["p50 latency"]) / 1e3,
                                  "p99_ms": float(row["p99 latency"]) / 1e3})
    result.client_cpu_s = (usage1.ru_utime + usage1.ru_stime) - (usage0.ru_utime + usage0.ru_stime)
    result.server_cpu_s = _delta(server.cpu_seconds(), srv0)
    result.stats = _stats_delta(model_statistics(server, spec.name), stats0)
    result.ok = result.stats[0] if result.stats else round(rate * seconds)
    return result


def choose_client(client: str, servers: Mapping[str, Server], specs: Sequence[ModelSpec]) -> tuple[str, str | None]:
    """``(client, why not perf_analyzer)``: perf_analyzer if asked for or (``auto``) if it runs against
    every server and model, else the local client."""
    if client == "local":
        return "local", "the local client was asked for"
    path = find_perf_analyzer()
    problem = perf_analyzer_problem(path)
    if problem is None:
        try:
            for spec in specs:
                for server in servers.values():
                    perf_analyzer_block(path, server, spec, 1, 0.0, probe=True)
        except (ServerError, subprocess.TimeoutExpired) as exc:
            problem = common.error_text(exc, 500)
    if problem is None:
        return "perf_analyzer", None
    if client == "perf_analyzer":
        raise ServerError(problem)
    return "local", problem


# -- the measurement --------------------------------------------------------------------------------
def summarize(blocks: Sequence[BlockResult]) -> dict[str, Any]:
    """One server's figures at one level, over its blocks (rounds): pooled samples for the local
    client, the mean of perf_analyzer's per-block figures."""
    elapsed = sum(b.elapsed_s for b in blocks)
    ok, errors = sum(b.ok for b in blocks), sum(b.errors for b in blocks)
    out: dict[str, Any] = {"client": blocks[0].client, "requests": ok, "errors": errors}
    if blocks[0].client == "local":
        latencies = [s for b in blocks for s in b.latencies]
        out["infer_per_s"] = ok / elapsed if ok else 0.0
        out.update(common.percentiles_ms(latencies) if latencies else {"p50_ms": None, "p99_ms": None, "max_ms": None})
    else:
        for key in ("infer_per_s", "p50_ms", "p99_ms"):
            out[key] = float(np.mean([b.figures[key] for b in blocks]))
    cpu = [b.client_cpu_s for b in blocks]
    out["client_cpu_cores"] = sum(cpu) / elapsed if elapsed and None not in cpu else None
    srv = [b.server_cpu_s for b in blocks]
    out["server_cpu_cores"] = sum(srv) / elapsed if elapsed and None not in srv else None
    stats = [b.stats for b in blocks]
    if None not in stats and sum(s[1] for s in stats):
        out["requests_per_execution"] = sum(s[0] for s in stats) / sum(s[1] for s in stats)
    if errors:
        out["error_samples"] = [e for b in blocks for e in b.error_samples][:3]
    return out


def measure_model(servers: Mapping[str, Server], spec: ModelSpec, *, client: str, levels: Sequence[int],
                  seconds: float, warmup: float, rounds: int, verbose: bool = True) -> dict[str, Any]:
    """Check the servers agree on ``spec``, then time every level, the servers taking turns."""
    agreement = check_agreement(servers, spec)
    path = find_perf_analyzer()
    kinds = list(servers)
    per_level: dict[str, Any] = {}
    for index, level in enumerate(levels):
        blocks: dict[str, list[BlockResult]] = {kind: [] for kind in kinds}
        for round_ in range(rounds):
            shift = (index + round_) % len(kinds)  # rotate: no server always follows the same one
            for kind in kinds[shift:] + kinds[:shift]:
                server = servers[kind]
                if client == "perf_analyzer":
                    warm = asyncio.run(local_block(server, spec, level, 0.0, warmup))  # the warm-up only
                    blocks[kind].append(perf_analyzer_block(path, server, spec, level, seconds,
                                                            latency_s=max(warm.latencies, default=0.0)))
                else:
                    blocks[kind].append(asyncio.run(local_block(server, spec, level, seconds, warmup)))
                if server.proc.poll() is not None:  # its errors would say little: say why
                    raise ServerError(f"the {kind} server died (status {server.proc.returncode}):\n"
                                      f"{server.log_tail()}")
        row = {kind: summarize(blocks[kind]) for kind in kinds}
        base = row.get(BASELINE, {})
        for kind, figures in row.items():
            figures["throughput_vs_baseline"] = _ratio(figures.get("infer_per_s"), base.get("infer_per_s"))
            figures["p99_vs_baseline"] = _ratio(figures.get("p99_ms"), base.get("p99_ms"))
        per_level[str(level)] = row
        if verbose:
            print(f"  concurrency {level}: " + ", ".join(f"{k} {common.fmt(v['infer_per_s'])}/s" for k, v in row.items()),
                  flush=True)
    return {"batchable": spec.batchable, "input_shapes": {k: list(v.shape) for k, v in spec.inputs.items()},
            "agreement": agreement, "concurrency": per_level}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def default_workers() -> int:
    """Workers of the multi-worker server: 2 where there are 2 cores or more (0: none)."""
    return 2 if (os.cpu_count() or 1) >= 2 else 0


def run(models: Sequence[str] = ("digits", "squeezenet"), *, levels: Sequence[int] = LEVELS, seconds: float = 5.0,
        warmup: float = 1.0, rounds: int = 2, client: str = "auto", threads: int | None = None,
        workers: int | None = None, verbose: bool = True) -> dict[str, Any]:
    """Start the servers, pick the client, measure every model; stop the servers whatever happens.
    ``workers`` > 1 adds ``asyncinfer serve --workers <workers>`` (default `default_workers`)."""
    if client not in CLIENTS:
        raise ValueError(f"client must be one of {CLIENTS}, got {client!r}")
    threads = threads or common.default_threads()
    workers = default_workers() if workers is None else workers
    kinds = kinds_for(workers)
    specs, per_model = {}, {}
    for name in models:
        try:
            specs[name] = model_spec(name)
        except FileNotFoundError as exc:
            per_model[name] = {"error": common.error_text(exc)}
    with running_servers({n: s.path for n, s in specs.items()}, threads, kinds, verbose=verbose) as servers:
        chosen, why_not = choose_client(client, servers, list(specs.values()))
        if verbose:
            print(f"client: {chosen}" + (f" ({why_not})" if why_not else ""), flush=True)
        per_model.update(common.measure_each(
            list(specs), "serving_load",
            lambda name: measure_model(servers, specs[name], client=chosen, levels=levels, seconds=seconds,
                                       warmup=warmup, rounds=rounds, verbose=verbose), verbose))
    return {"client": chosen, "perf_analyzer_unused_because": why_not, "cores": os.cpu_count(),
            "client_note": f"the client runs on the same {os.cpu_count()} cores as the servers",
            "threads": threads, "levels": list(levels), "seconds_per_block": seconds, "warmup_s": warmup,
            "rounds": rounds, "servers": {kind: describe_server(kind) for kind in kinds}, "workers": workers,
            "blas_threads_env": {k: os.environ.get(k) for k in BLAS_ENV},
            "models": {name: per_model[name] for name in models}}


# -- report -----------------------------------------------------------------------------------------
def print_report(result: dict[str, Any]) -> None:
    rows = []
    for name, r in result["models"].items():
        if "error" in r:
            rows.append([name, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", r["error"][:60]])
            continue
        for level, row in r["concurrency"].items():
            for kind, f in row.items():
                per_exec = f.get("requests_per_execution")
                rows.append([name, level, kind, f["infer_per_s"], _cell(f["throughput_vs_baseline"]), _cell(f["p50_ms"]),
                             _cell(f["p99_ms"]), _cell(f["p99_vs_baseline"]), f["errors"], _cell(per_exec),
                             _cell(f["client_cpu_cores"]), _cell(f["server_cpu_cores"])])
    common.print_table(["model", "conc", "server", "infer/s", "×base", "p50 ms", "p99 ms", "p99 ×base", "errors",
                        "req/exec", "client cpu", "server cpu"], rows,
                       title=f"Serving load over HTTP, batch-1 requests, {result['rounds']} round(s) of "
                             f"{result['seconds_per_block']} s per level and server")
    print(f"client: {result['client']}" + (f" ({result['perf_analyzer_unused_because']})"
                                           if result["perf_analyzer_unused_because"] else ""))
    print(f"{result['client_note']}; 'cpu' columns are cores busy (client: the bench process or perf_analyzer).")
    for name, r in result["models"].items():
        if "agreement" in r:
            worst = max(r["agreement"]["max_abs_diff"].values())
            print(f"{name}: every server agrees with the baseline (binary and JSON), max abs diff {worst:.3g}")


def _cell(value: Any) -> Any:
    return "-" if value is None else value


# -- `python -m bench` (bench/runner.py) ---------------------------------------------------------
# The --quick profile: every model and level, one short block per server (about 20 s in all with the
# local client, 40 s with perf_analyzer, on 2 cores).
QUICK: dict[str, Any] = {"seconds": 0.4, "warmup": 0.2, "rounds": 1}
KEY_LEVEL = "8"  # the target: at concurrency 8, dynamic batching ≥ 1.5× the baseline, p99 no worse


def unavailable_reason() -> str | None:
    """Why this benchmark cannot run here, or None (it needs the server extras and the baseline's)."""
    return common.missing_modules("onnxruntime", "uvicorn", "starlette", "fastapi")


def key_figures(result: dict[str, Any]) -> dict[str, float | None]:
    """Per model, at concurrency 8: asyncinfer's throughput and p99 over the baseline's (one
    process, and the multi-worker server where measured)."""
    figures: dict[str, float | None] = {}
    for name, r in result["models"].items():
        row = (r.get("concurrency") or {}).get(KEY_LEVEL) or {}
        for kind in dict.fromkeys(["asyncinfer", floor_kind(row)]):
            label = "" if kind == "asyncinfer" else f" {kind}"
            figures[f"{name} c{KEY_LEVEL}{label} infer/s ×base"] = common.dig(row, kind, "throughput_vs_baseline")
            figures[f"{name} c{KEY_LEVEL}{label} p99 ×base"] = common.dig(row, kind, "p99_vs_baseline")
        figures[f"{name} c{KEY_LEVEL} unbatched infer/s ×base"] = common.dig(
            r, "concurrency", KEY_LEVEL, "asyncinfer_unbatched", "throughput_vs_baseline")
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["digits", "squeezenet"],
                        help="'digits' (the embedded CNN) and/or light model-zoo names (default: digits squeezenet)")
    parser.add_argument("--levels", nargs="+", type=int, default=list(LEVELS),
                        help="concurrency levels: requests in flight (default 1 4 8 16)")
    parser.add_argument("--seconds", type=float, default=5.0, help="timed seconds per block (default 5)")
    parser.add_argument("--warmup", type=float, default=1.0, help="untimed seconds before each block (default 1)")
    parser.add_argument("--rounds", type=int, default=2, help="blocks per server and level, alternating (default 2)")
    parser.add_argument("--client", choices=CLIENTS, default="auto",
                        help="auto: perf_analyzer when it runs against every server, else local (default)")
    parser.add_argument("--workers", type=int, default=None,
                        help="also measure 'asyncinfer serve --workers N' (N > 1; default 2 where there are 2 cores "
                             "or more; 0: not)")
    common.add_engine_args(parser, "serving_load.json")
    args = parser.parse_args(argv)
    if (reason := unavailable_reason()) is not None:
        return common.cannot_run(__file__, reason)
    try:
        result = run(args.models, levels=args.levels, seconds=args.seconds, warmup=args.warmup, rounds=args.rounds,
                     client=args.client, threads=args.threads, workers=args.workers)
    except KeyboardInterrupt:  # the servers are already stopped
        print("interrupted", file=sys.stderr)
        return 130
    return common.report("serving_load", result, print_report, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
