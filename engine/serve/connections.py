"""How the HTTP server treats connections: header deadline, connection and size caps, quiet logs."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.serve.log_limit import RateLimitedLog, client_and_status

HEADER_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5
MAX_CONNECTIONS = 1000
MAX_HEADER_BYTES = 64 << 10


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers are late."""

    header_timeout_s = HEADER_TIMEOUT_S
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()
        super().data_received(data)
        if self._deadline is not None and self.conn.their_state is not h11.IDLE:
            self._deadline.cancel()  # headers in: an armed deadline would cut it idle
            self._deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._deadline = self.loop.call_later(self.header_timeout_s, self._expire)

    def _expire(self) -> None:
        self._deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def server_config(app: ASGIApp, *, max_connections: int = MAX_CONNECTIONS,
                  header_timeout_s: float = HEADER_TIMEOUT_S, **options: Any) -> uvicorn.Config:
    """The uvicorn Config every tokenflow HTTP server runs with; `options` are uvicorn's."""
    protocol = type("HeaderDeadline", (HeaderDeadlineProtocol,),
                    {"header_timeout_s": header_timeout_s})
    RateLimitedLog.install(logging.getLogger("uvicorn.error"))
    RateLimitedLog.install(logging.getLogger("uvicorn.access"), kind=client_and_status)
    return uvicorn.Config(app, http=protocol, limit_concurrency=max_connections,
                          timeout_keep_alive=KEEP_ALIVE_S,
                          h11_max_incomplete_event_size=MAX_HEADER_BYTES, **options)
