"""``asyncinfer serve``: the repository and gRPC options, and HTTP + gRPC over one service in one loop."""
from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

import asyncinfer as ai
from asyncinfer import assets
from asyncinfer.serving import cli as serve_cli
from asyncinfer.serving import create_app
from asyncinfer.serving.cli import add_serve_command, run_serve
from asyncinfer.serving.service import InferenceService


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    (tmp_path / "digits" / "1").mkdir(parents=True)
    shutil.copyfile(assets.default_model_path(), tmp_path / "digits" / "1" / "model.onnx")
    return tmp_path


def test_the_repository_options_reach_the_service(repository, monkeypatch):
    import uvicorn

    ran: dict = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: ran.update(app=app, **kwargs))
    args = parse("--model-repository", str(repository), "--model-control-mode", "explicit", "--load-model", "digits",
                 "--repository-poll-secs", "2.5", "--no-strict-readiness", "--max-queue", "5")
    assert run_serve(args) == 0
    service = ran["app"].state.service
    assert isinstance(service, InferenceService) and service.repository.root == repository
    assert (service.model_control_mode, service.load_models, service.repository_poll_secs) == ("explicit", ["digits"],
                                                                                               2.5)
    assert not service.strict_readiness and service.admission.max_queue == 5
    defaults = parse()
    assert (defaults.model_repository, defaults.model_control_mode, defaults.grpc_port, defaults.load_model) == (
        None, "none", 0, [])


@pytest.mark.parametrize("argv, message", [
    (["a.onnx", "--model-repository", "{repo}"], "give MODEL arguments or --model-repository, not both"),
    (["--model-control-mode", "poll"], "--model-control-mode and --load-model need --model-repository"),
    (["--model-repository", "{repo}", "--load-model", "digits"], "--load-model is for --model-control-mode explicit"),
    (["--model-repository", "{repo}/missing"], "not a directory"),
])
def test_inconsistent_repository_options_are_errors(repository, argv, message, capsys):
    args = parse(*[a.replace("{repo}", str(repository)) for a in argv])
    assert run_serve(args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--grpc-port", "70000"], ["--grpc-port", "x"], ["--model-control-mode", "auto"],
                                  ["--repository-poll-secs", "0"]])
def test_out_of_range_options_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(*argv)
    assert exit_.value.code == 2 and "Traceback" not in capsys.readouterr().err


def test_grpc_port_runs_both_servers_in_one_loop(monkeypatch):
    seen: dict = {}

    async def fake(service, http, host, port, drain_timeout, on_started=None):
        seen.update(service=service, http=http, host=host, port=port, loop=asyncio.get_running_loop())
        return 0

    monkeypatch.setattr(serve_cli, "serve_http_and_grpc", fake)
    assert run_serve(parse("--grpc-port", "9100", "--port", "9101")) == 0
    assert seen["port"] == 9100 and seen["http"].config.port == 9101
    assert seen["http"].config.app.state.service is seen["service"]  # one service for both


class _OnSocket:
    """A uvicorn server that serves on a socket bound beforehand (no race for a free port)."""

    def __init__(self, server, sock):
        self.server, self.sock = server, sock

    @property
    def started(self) -> bool:
        return self.server.started

    async def serve(self) -> None:
        await self.server.serve(sockets=[self.sock])


def test_http_and_grpc_share_one_service(digits_samples):
    http_client = pytest.importorskip("tritonclient.http")
    grpc_client = pytest.importorskip("tritonclient.grpc")
    uvicorn = pytest.importorskip("uvicorn")

    service = InferenceService({"digits": assets.default_model_path()})
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    http = uvicorn.Server(uvicorn.Config(create_app(service=service, manage_service=False), log_level="warning"))
    grpc_started = threading.Event()
    grpc_port: list[int] = []
    result: list[int] = []

    def on_started(server) -> None:
        grpc_port.append(server.port)
        grpc_started.set()

    def main() -> None:
        result.append(asyncio.run(serve_cli.serve_http_and_grpc(service, _OnSocket(http, sock), "127.0.0.1", 0, 5.0,
                                                                on_started)))

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    try:
        assert grpc_started.wait(20), "the gRPC server did not start"
        for _ in range(2000):
            if http.started or not thread.is_alive():
                break
            threading.Event().wait(0.01)
        assert http.started, "uvicorn did not start"
        images = digits_samples[0][:2]
        with ai.Worker(ai.load_model(assets.default_model_path())) as worker:
            expected = worker.run_blocking(images)["probabilities"]
        over_http = http_client.InferenceServerClient(f"127.0.0.1:{sock.getsockname()[1]}")
        over_grpc = grpc_client.InferenceServerClient(f"127.0.0.1:{grpc_port[0]}")
        for client, module in ((over_http, http_client), (over_grpc, grpc_client)):
            tensor = module.InferInput("image", list(images.shape), "FP32")
            tensor.set_data_from_numpy(images)
            np.testing.assert_allclose(client.infer("digits", [tensor]).as_numpy("probabilities"), expected,
                                       rtol=1e-5, atol=1e-5)
        # one service: the statistics count both requests
        stats = over_http.get_inference_statistics("digits")["model_stats"][0]["inference_stats"]
        assert stats["success"]["count"] == 2
        over_http.close()
        over_grpc.close()
    finally:
        http.should_exit = True
        thread.join(timeout=30)
        sock.close()
    assert not thread.is_alive() and result == [0]
    assert not service.live()  # drained and disposed after both servers stopped
