"""A real uvicorn server on a thread of the test process, for clients that need a socket
(tritonclient, the ``openai`` client, streaming over HTTP)."""
from __future__ import annotations

import socket
import threading

import uvicorn


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # held from the start: no race with other processes for the port
    return sock


class ServerThread:
    """uvicorn serving ``app`` on a thread of its own, on a free port (``port``, ``url``)."""

    def __init__(self, app):
        self.sock = free_socket()
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        for _ in range(2000):  # up to 20 s
            if self.server.started or not self.thread.is_alive():
                break
            threading.Event().wait(0.01)
        assert self.server.started, "uvicorn did not start"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.sock.close()
        assert not self.thread.is_alive(), "uvicorn did not stop"
