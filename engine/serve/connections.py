"""How the HTTP server treats connections: header and body deadlines, connection caps (in all
and per address), size caps, and logs that a flood cannot fill."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.serve.log_limit import RateLimitedLog, client_and_status

HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 10.0  # from the end of the headers to the end of the body
KEEP_ALIVE_S = 5
MAX_CONNECTIONS = 1000
MAX_CONNECTIONS_PER_ADDRESS = 256
MAX_HEADER_BYTES = 64 << 10
ACCEPT_LOG_INTERVAL_S = 1.0
# Out of descriptors, accepting resumes after these pauses, longer while it lasts (asyncio's own
# accept loop paused one second each time, and a newcomer waited that long).
ACCEPT_RETRY_S = (0.002, 0.01, 0.05, 0.2)
SHED_AT_ONCE = 8  # idle connections closed each time the descriptors run out
ACCEPT_PER_TICK = 32  # so refused connections are closed before many more are accepted
OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
TOO_MANY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nRetry-After: 1\r\nContent-Length: %d\r\n\r\n%b")
TOO_MANY_BODY = (b'{"error": {"message": "too many connections from this address; close idle '
                 b'ones or retry after 1 s", "type": "server_error", "param": null, '
                 b'"code": 503}}')
log = logging.getLogger("tokenflow.serve")


class ConnectionGuard:
    """One server's open connections by client address, and the clock its deadlines read."""

    def __init__(self, per_address: int = MAX_CONNECTIONS_PER_ADDRESS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_address = per_address
        self.clock = clock
        self.open: dict[str, int] = {}
        # connections waiting for a request's headers, longest-waiting first: the first to go
        # when the descriptors run out
        self.idle: dict[DeadlineProtocol, None] = {}
        self.shed_count = 0

    def full(self, address: str) -> bool:
        return self.open.get(address, 0) >= self.per_address

    def admit(self, address: str) -> bool:
        if self.full(address):
            return False
        self.open[address] = self.open.get(address, 0) + 1
        return True

    def release(self, address: str) -> None:
        count = self.open.pop(address, 0) - 1
        if count > 0:
            self.open[address] = count

    def shed(self, count: int) -> int:
        """Close up to `count` of the connections that have waited longest for their request's
        headers (they hold a descriptor and ask nothing); how many were closed."""
        shed = 0
        while self.idle and shed < count:
            protocol = next(iter(self.idle))
            self.idle.pop(protocol)
            if protocol.shed():
                shed += 1
        self.shed_count += shed
        return shed


class DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers or body are late,
    and refusing one past its address's cap."""

    header_timeout_s = HEADER_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S
    guard: ConnectionGuard
    _timer: asyncio.TimerHandle | None = None
    _due: float = 0.0
    _phase: object = None  # h11.IDLE: waiting for headers; h11.SEND_BODY: for the body
    _address: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if not self.guard.admit(address):
            transport.write(TOO_MANY % (len(TOO_MANY_BODY), TOO_MANY_BODY))
            transport.close()
            return
        self._address = address
        self._arm(h11.IDLE, self.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._address is None:
            return  # refused: the 503 is on its way
        if self._timer is None and self.conn.their_state is h11.IDLE:
            self._arm(h11.IDLE, self.header_timeout_s)
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY and self._phase is not h11.SEND_BODY:
            self._arm(h11.SEND_BODY, self.body_timeout_s)
        elif state is not self._phase:
            self._disarm()  # the awaited part is in: an armed deadline would cut it idle

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._address is not None:
            self.guard.release(self._address)
            self._address = None
        super().connection_lost(exc)

    def _arm(self, phase: object, timeout_s: float) -> None:
        self._disarm()
        self._phase = phase
        self._due = self.guard.clock() + timeout_s
        self._timer = self.loop.call_later(timeout_s, self.expire)
        if phase is h11.IDLE:
            self.guard.idle[self] = None

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._phase = None
        self.guard.idle.pop(self, None)

    def shed(self) -> bool:
        """Closed to free a descriptor, if it still waits for its request's headers."""
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return False
        self._disarm()
        self.transport.abort()  # at once: its descriptor is what is missing
        return True

    def expire(self) -> None:
        """Close the connection if what it was waiting for is still late by the guard's clock."""
        self._timer = None
        left = self._due - self.guard.clock()
        if left > 0:  # the guard's clock is behind the loop's: look again then
            self._timer = self.loop.call_later(left, self.expire)
            return
        if self.conn.their_state is self._phase and not self.transport.is_closing():
            self.transport.close()
        self._phase = None
        self.guard.idle.pop(self, None)


class AcceptErrorLog:
    """The event loop's exception handler: at most one line a second per kind of error, with a
    count of those since the last line, never a traceback (the file limit made asyncio print
    one per failed accept)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 interval_s: float = ACCEPT_LOG_INTERVAL_S,
                 logger: logging.Logger = log) -> None:
        self.clock = clock
        self.interval_s = interval_s
        self.logger = logger
        self.last: dict[str, float] = {}
        self.unsaid: dict[str, int] = {}

    def __call__(self, _loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        message = str(context.get("message") or "event loop error")
        kind = f"{message}: {type(exc).__name__}" if exc is not None else message
        now = self.clock()
        last = self.last.get(kind)
        if last is not None and 0 <= now - last < self.interval_s:
            self.unsaid[kind] = self.unsaid.get(kind, 0) + 1
            return
        if kind not in self.last and len(self.last) >= 64:  # kinds remembered are bounded
            oldest = min(self.last, key=self.last.__getitem__)
            self.last.pop(oldest)
            self.unsaid.pop(oldest, None)
        self.last[kind] = now
        count = self.unsaid.pop(kind, 0)
        more = f" ({count} more since the last line)" if count else ""
        self.logger.error("%s%s%s", message, f": {exc}" if exc is not None else "", more)


def refuse(conn: socket.socket) -> None:
    """Answer 503 on a fresh connection past its address's cap and close it, without waiting:
    a client that does not read it loses only the answer. What it sent already is read first,
    so the close is a FIN that leaves the answer readable, not a reset."""
    with contextlib.suppress(OSError):
        conn.send(TOO_MANY % (len(TOO_MANY_BODY), TOO_MANY_BODY))
        conn.recv(MAX_HEADER_BYTES)
    conn.close()


class AcceptBackoff:
    """How long to pause accepting after running out of descriptors: short at first, longer
    while it lasts, short again after a connection is accepted."""

    def __init__(self, delays: tuple[float, ...] = ACCEPT_RETRY_S) -> None:
        self.delays = delays
        self.failures = 0

    def failed(self) -> float:
        delay = self.delays[min(self.failures, len(self.delays) - 1)]
        self.failures += 1
        return delay

    def accepted(self) -> None:
        self.failures = 0


class Acceptor:
    """Accepts a listening socket's connections for the server's protocol, in place of asyncio's
    accept loop: out of descriptors, asyncio stopped accepting for a second; this closes the
    connections that waited longest for their headers and accepts again after AcceptBackoff."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                 factory: Callable[[], asyncio.Protocol], guard: ConnectionGuard) -> None:
        self.loop = loop
        self.sock = sock
        self.factory = factory
        self.guard = guard
        self.backoff = AcceptBackoff()
        self.out_of_files = 0
        self._retry: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        sock.setblocking(False)
        loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(ACCEPT_PER_TICK):
            try:
                conn, peer = self.sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno in OUT_OF_RESOURCES:
                    self._out_of_files(exc)
                else:
                    self.loop.call_exception_handler({"message": "socket.accept() failed",
                                                      "exception": exc})
                return
            self.backoff.accepted()
            conn.setblocking(False)
            if isinstance(peer, tuple) and peer and self.guard.full(str(peer[0])):
                refuse(conn)  # before a transport and a protocol are built for it
                continue
            task = self.loop.create_task(self._connect(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _out_of_files(self, exc: OSError) -> None:
        self.out_of_files += 1
        self.loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                          "exception": exc})
        self.guard.shed(SHED_AT_ONCE)
        self.loop.remove_reader(self.sock.fileno())
        self._retry = self.loop.call_later(self.backoff.failed(), self._resume)

    def _resume(self) -> None:
        self._retry = None
        self.loop.add_reader(self.sock.fileno(), self._accept)

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(self.factory, conn)
        except Exception as exc:  # the client left already, or no memory for its buffers
            conn.close()
            self.loop.call_exception_handler({"message": "a connection could not be set up",
                                              "exception": exc})

    def close(self) -> None:
        """Stop accepting (the socket itself is its owner's to close)."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        elif self.sock.fileno() >= 0:
            self.loop.remove_reader(self.sock.fileno())


class GuardedServer(uvicorn.Server):
    """uvicorn's server with the event loop's errors through AcceptErrorLog, and the sockets
    it is given accepted by Acceptor."""

    acceptors: list[Acceptor]

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(AcceptErrorLog())
        self.acceptors = []
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if sockets is None:  # uvicorn binds the address itself, and accepts on it
            await super().startup(sockets)
            return
        await super().startup(sockets=[])
        loop = asyncio.get_running_loop()
        config = self.config

        def factory() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state,
                app_state=self.lifespan.state, _loop=loop)

        guard = getattr(config.http_protocol_class, "guard", None)
        if not isinstance(guard, ConnectionGuard):
            guard = ConnectionGuard()
        self.acceptors = [Acceptor(loop, sock, factory, guard) for sock in sockets]

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for acceptor in self.acceptors:
            acceptor.close()
        await super().shutdown(sockets)


def server_config(app: ASGIApp, *, max_connections: int = MAX_CONNECTIONS,
                  header_timeout_s: float = HEADER_TIMEOUT_S,
                  body_timeout_s: float = BODY_TIMEOUT_S,
                  per_address: int = MAX_CONNECTIONS_PER_ADDRESS,
                  clock: Callable[[], float] = time.monotonic, **options: Any) -> uvicorn.Config:
    """The uvicorn Config every tokenflow HTTP server runs with; `options` are uvicorn's."""
    protocol = type("Deadline", (DeadlineProtocol,),
                    {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s,
                     "guard": ConnectionGuard(per_address, clock)})
    RateLimitedLog.install(logging.getLogger("uvicorn.error"))
    RateLimitedLog.install(logging.getLogger("uvicorn.access"), kind=client_and_status)
    return uvicorn.Config(app, http=protocol, limit_concurrency=max_connections,
                          timeout_keep_alive=KEEP_ALIVE_S,
                          h11_max_incomplete_event_size=MAX_HEADER_BYTES, **options)
