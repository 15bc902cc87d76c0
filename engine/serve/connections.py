"""How the HTTP server treats connections: a deadline for request headers, a cap on
connections, a cap on header size, and warnings that cannot flood the log.

uvicorn arms no timer on a connection until its first response, so a client that connects
and sends nothing (or a header byte a second) holds the connection forever: 21,000 idle ones
made new requests time out. Here every request's headers must arrive whole within
HEADER_TIMEOUT_S of its first byte (of the connection, for the first), beyond
`max_connections` new requests are answered 503 at once, and uvicorn's per-request warnings
and access lines pass through a rate limit (engine.serve.log_limit).
"""

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
KEEP_ALIVE_S = 5  # idle between requests on one connection (uvicorn's default)
MAX_CONNECTIONS = 1000
MAX_HEADER_BYTES = 64 << 10  # of a request line and headers; h11 answers 400 beyond


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers are late."""

    header_timeout_s = HEADER_TIMEOUT_S
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first byte of the next request on a kept-alive connection
        super().data_received(data)
        if self._deadline is not None and self.conn.their_state is not h11.IDLE:
            self._deadline.cancel()  # the headers are in: a deadline left armed would cut
            self._deadline = None  # the connection while it idles between requests

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
            self.transport.close()  # still no whole request line and headers


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
