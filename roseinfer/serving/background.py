"""A server on a background thread of this process: for notebooks and scripts that want
to talk to a real server and stop it themselves (`python -m roseinfer.cli.serve` is the
command-line way)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

from rosetrainer.errors import RoseError


class BackgroundServer:
    """`with BackgroundServer(app) as server:` serves `app` on 127.0.0.1 at a free port
    (`server.url`) until the block ends, also when it ends with an error."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", timeout: float = 60.0) -> None:
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, args=([self.sock],), daemon=True)
        self.timeout = timeout

    def start(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + self.timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RoseError("the background server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Stop accepting, let requests in flight finish, stop the engine thread."""
        self.server.should_exit = True
        self.thread.join(self.timeout)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
