"""``asyncinfer serve --workers 2``: one address, two worker processes, one server's numbers.

Each test starts the command as a subprocess (``--port 0``: the supervisor says which port it
bound) with ``TMPDIR`` in the test's folder, so the group's folder (`asyncinfer.serving.multiprocess`)
can be looked at: which worker answered is read from the counters each worker writes there.
Requests go over fresh connections (urllib opens one per request): each is accepted by
whichever worker takes it first, so a few dozen reach both.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from asyncinfer import assets
from conftest import free_port

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="--workers is POSIX only")
pytest.importorskip("uvicorn")
parser = pytest.importorskip("prometheus_client.parser")

HANG = 60.0  # seconds before a wait is a failure: a hang guard, not a timing
REPO_ROOT = Path(__file__).resolve().parents[2]


class Group:
    """``asyncinfer serve --workers 2 ...`` in a subprocess, and its group folder."""

    def __init__(self, tmp: Path, *options: str):
        self.tmp = tmp
        self.log = tmp / "serve.log"
        env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=os.pathsep.join(
            filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "asyncinfer", "serve", "--workers", "2", "--port", "0",
                                          "--log-level", "warning", *options], env=env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.port = self.grpc_port = 0
        self.requests = 0  # inference requests answered 200 so far

    def wait_ready(self) -> None:
        deadline = time.monotonic() + HANG
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited with {self.proc.returncode}:\n{self.log.read_text()}")
            found = re.search(r"serving at http://127\.0\.0\.1:(\d+)/v2(?: and gRPC at 127\.0\.0\.1:(\d+))?",
                              self.log.read_text())
            if found and len(self.pids()) == 2:
                self.port, self.grpc_port = int(found[1]), int(found[2] or 0)
                if get(self.url("/v2/health/ready"))[0] == 200:
                    return
            time.sleep(0.05)
        raise AssertionError(f"serve --workers 2 not ready after {HANG} s:\n{self.log.read_text()}")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _folders(self) -> list[Path]:
        """The group's folder: in its TMPDIR, or in /tmp where that one is too deep for the
        workers' sockets (`supervisor._make_folder`)."""
        pattern = f"asyncinfer-workers-{self.proc.pid}-*"
        return [*self.tmp.glob(pattern), *Path("/tmp").glob(pattern)]

    @property
    def folder(self) -> Path:
        found = self._folders()
        assert len(found) == 1, found
        return found[0]

    def pids(self) -> dict[int, int]:
        """``{worker index: pid}`` of the workers serving now."""
        pids = {}
        for path in (ready for folder in self._folders() for ready in folder.glob("w*.ready")):
            with_pid = path.read_text()
            if with_pid.isdigit():
                pids[int(path.stem[1:])] = int(with_pid)
        return pids

    def served_by(self, total: int) -> dict[int, int]:
        """``{pid: successful requests}`` from the counters the workers write (a moment after
        they change), once they add up to ``total``."""
        deadline = time.monotonic() + HANG
        while time.monotonic() < deadline:
            counts = {}
            for path in self.folder.glob("stats/*.json"):
                try:
                    stats = json.loads(path.read_text())["statistics"]
                except (OSError, ValueError):
                    continue  # being replaced
                counts[int(path.stem)] = sum(s["success"][0] for s in stats)
            if sum(counts.values()) == total:
                return counts
            time.sleep(0.05)
        raise AssertionError(f"the workers' counters never added up to {total}: {counts}")

    def infer(self, count: int) -> list[int]:
        """``count`` requests, each over a new connection; their statuses."""
        statuses = [post(self.url("/v2/models/digits/infer"), digits_request())[0] for _ in range(count)]
        self.requests += statuses.count(200)
        return statuses

    def infer_until_served_by(self, pids: set[int]) -> None:
        """Infer in rounds until every worker of ``pids`` answered some (a few dozen, usually)."""
        for _ in range(20):
            assert self.infer(10) == [200] * 10
            if pids <= {pid for pid, n in self.served_by(self.requests).items() if n}:
                return
        raise AssertionError(f"200 requests, none answered by some of {pids}: {self.served_by(self.requests)}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(HANG)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode



def digits_request(rows: int = 1) -> dict:
    images = assets.default_samples()[0][:rows].astype(np.float32)
    return {"inputs": [{"name": "image", "shape": list(images.shape), "datatype": "FP32",
                        "data": images.ravel().tolist()}]}


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=HANG) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except OSError:
        return 0, b""


def post(url: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=HANG) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def success_count(group: Group) -> int:
    status, body = get(group.url("/v2/models/digits/stats"))
    assert status == 200, body
    return json.loads(body)["model_stats"][0]["inference_stats"]["success"]["count"]


@pytest.fixture(scope="module")
def group(tmp_path_factory) -> Group:
    started = Group(tmp_path_factory.mktemp("workers"), "--grpc-port", str(free_port()))
    try:
        started.wait_ready()
        yield started
    finally:
        started.stop()


# -- one server's numbers ----------------------------------------------------------------------------
def test_requests_reach_both_workers_and_statistics_add_up_exactly(group):
    group.infer_until_served_by(set(group.pids().values()))
    for _ in range(4):  # whichever worker answers, it counts every one's requests, at once
        assert success_count(group) == group.requests
    status, body = get(group.url("/v2/models/digits/stats"))
    stats = json.loads(body)["model_stats"][0]
    assert stats["inference_count"] == group.requests
    assert stats["execution_count"] == sum(b["compute_infer"]["count"] for b in stats["batch_stats"])


def test_metrics_parse_and_count_every_workers_requests(group):
    group.infer(6)
    status, body = get(group.url("/metrics"))
    assert status == 200
    families = {f.name: f for f in parser.text_string_to_metric_families(body.decode())}
    success = [s.value for s in families["nv_inference_request_success"].samples if s.labels["model"] == "digits"]
    assert success == [group.requests]
    executions = [s.value for s in families["nv_inference_exec_count"].samples if s.labels["model"] == "digits"]
    batches = [s.value for s in families["asyncinfer_batch_size"].samples if s.name == "asyncinfer_batch_size_count"]
    assert batches == executions  # the histogram (prometheus-client's files) agrees with the statistics
    pending = [s.value for s in families["nv_inference_pending_request_count"].samples]
    assert pending == [0.0]
    assert [s.value for s in families["asyncinfer_models_loaded"].samples] == [1.0]


def test_grpc_statistics_are_the_whole_servers(group):
    grpc_client = pytest.importorskip("tritonclient.grpc")
    group.infer(4)
    client = grpc_client.InferenceServerClient(f"127.0.0.1:{group.grpc_port}")
    try:
        stats = client.get_inference_statistics("digits", as_json=True)
    finally:
        client.close()
    assert int(stats["model_stats"][0]["inference_stats"]["success"]["count"]) == group.requests


def test_trace_settings_reach_every_worker(group):
    status, body = post(group.url("/v2/models/digits/trace/setting"), {"trace_rate": "7"})
    assert status == 200 and json.loads(body)["trace_rate"] == "7"
    for _ in range(12):  # fresh connections: both workers answer some of these
        assert json.loads(get(group.url("/v2/models/digits/trace/setting"))[1])["trace_rate"] == "7"
    assert post(group.url("/v2/models/digits/trace/setting"), {"trace_rate": None})[0] == 200
    for _ in range(12):
        assert json.loads(get(group.url("/v2/models/digits/trace/setting"))[1])["trace_rate"] == "1000"


# -- model control and restarts ----------------------------------------------------------------------
def test_load_and_unload_reach_every_worker_and_a_restarted_one_catches_up(tmp_path):
    repository = tmp_path / "models"
    (repository / "digits" / "1").mkdir(parents=True)
    shutil.copyfile(assets.default_model_path(), repository / "digits" / "1" / "model.onnx")
    group = Group(tmp_path, "--model-repository", str(repository), "--model-control-mode", "explicit")
    try:
        group.wait_ready()
        assert group.infer(2) == [404, 404]  # nothing loaded yet
        assert post(group.url("/v2/repository/models/digits/load"), {})[0] == 200
        first = group.pids()
        group.infer_until_served_by(set(first.values()))  # every worker loaded it: no 404, no 503

        served = group.served_by(group.requests)  # written to the folder: the dead worker's still count
        os.kill(first[0], signal.SIGKILL)
        deadline = time.monotonic() + HANG
        while group.pids().get(0) in (None, first[0]):
            assert time.monotonic() < deadline, f"worker 0 was not restarted:\n{group.log.read_text()}"
            time.sleep(0.05)
        restarted = group.pids()[0]
        assert "worker 0 (pid" in group.log.read_text()  # the death is logged
        group.infer_until_served_by({restarted})  # it loaded the model the API loaded before it started
        assert success_count(group) == group.requests
        assert group.served_by(group.requests)[first[0]] == served[first[0]]

        assert post(group.url("/v2/repository/models/digits/unload"), {})[0] == 200
        assert set(group.infer(12)) == {503}  # unloaded in every worker
    finally:
        assert group.stop() == 0


def test_sigterm_drains_a_request_in_flight_then_exits_0(tmp_path):
    group = Group(tmp_path, "--drain-timeout", "20")
    group.wait_ready()
    folder, pids = group.folder, group.pids()
    body = json.dumps(digits_request()).encode()
    with socket.create_connection(("127.0.0.1", group.port), timeout=HANG) as conn:
        conn.sendall(b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:10])
        deadline = time.monotonic() + HANG
        while True:  # admitted (waiting for the rest of its body): in flight
            families = parser.text_string_to_metric_families(get(group.url("/metrics"))[1].decode())
            pending = {f.name: f for f in families}["nv_inference_pending_request_count"].samples
            if pending and pending[0].value == 1:
                break
            assert time.monotonic() < deadline, "the request was never admitted"
            time.sleep(0.05)
        group.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)  # not needed for correctness: gives the drain a chance to have begun
        conn.sendall(body[10:])
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = conn.recv(65536)
            assert chunk, "the connection closed without an answer"
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert group.stop() == 0
    assert not folder.exists()  # the supervisor removed the group's folder
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_worker_that_cannot_start_stops_the_supervisor(tmp_path):
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not an onnx file")
    stale = tmp_path / "asyncinfer-workers-99999999-left"  # of a supervisor killed outright (no such pid)
    (stale / "stats").mkdir(parents=True)
    group = Group(tmp_path, str(broken))
    try:
        assert group.proc.wait(HANG) == 1
    finally:
        group.stop()
    log = group.log.read_text()
    assert "ModelLoadError" in log and "could not start" in log, log
    assert not list(tmp_path.glob("asyncinfer-workers-*"))  # its own folder, and the stale one


# -- the option ----------------------------------------------------------------------------------------
def parse(*argv: str):
    import argparse

    from asyncinfer.serving.cli import add_serve_command

    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_the_workers_option(capsys):
    from asyncinfer.serving.cli import run_serve
    from asyncinfer.serving.supervisor import worker_threads

    assert parse().workers == 1 and parse("--workers", "3").workers == 3
    assert parse("--workers", "auto").workers == (os.cpu_count() or 1)
    for bad in ("0", "x"):
        with pytest.raises(SystemExit) as exit_:
            parse("--workers", bad)
        assert exit_.value.code == 2 and "Traceback" not in capsys.readouterr().err
    assert run_serve(parse("--workers", "2", "--ray")) == 2
    assert "--workers is for one machine" in capsys.readouterr().err
    assert [worker_threads(n, cores=8) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]  # never oversubscribed


def test_a_long_temporary_folder_still_leaves_the_sockets_a_short_path(tmp_path, monkeypatch):
    """A TMPDIR too deep for a Unix socket's address (108 bytes) puts the group's folder in /tmp
    instead: its workers' sockets could not be bound there ("AF_UNIX path too long")."""
    from asyncinfer.serving import supervisor

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(supervisor.tempfile, "tempdir", str(deep))
    folder = supervisor._make_folder()
    try:
        assert len(str(folder / "w9999.sock")) <= supervisor.SOCKET_PATH_MAX
        assert folder.name.startswith(f"{supervisor.FOLDER_PREFIX}{os.getpid()}-")
    finally:
        folder.rmdir()
    short = Path(tempfile.mkdtemp(prefix="s", dir="/tmp"))  # a short one is kept
    try:
        monkeypatch.setattr(supervisor.tempfile, "tempdir", str(short))
        folder = supervisor._make_folder()
        assert folder.parent == short
        folder.rmdir()
    finally:
        short.rmdir()
