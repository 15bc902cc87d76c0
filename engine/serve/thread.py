"""A uvicorn server on a background thread, listening before it starts (tests, benchmarks)."""

from __future__ import annotations

import threading
from types import TracebackType

from starlette.types import ASGIApp

from engine.serve.connections import GuardedServer, server_config
from engine.serve.listener import BACKLOG, listen

GRACEFUL_SHUTDOWN_S = 2


class ServerThread:
    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0, *,
                 nodelay: bool = True) -> None:
        self.sock = listen(host, port, nodelay=nodelay)
        config = server_config(app, log_level="warning", lifespan="off", backlog=BACKLOG,
                               timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        self.server = GuardedServer(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="tokenflow-http", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def start(self) -> ServerThread:
        self.thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()
