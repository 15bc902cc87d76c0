"""A remote server the console polls, and whether it is reachable right now.

After a failure the next attempt waits (0.5 s, doubling to 10 s); until then calls fail fast
with the same message, so the console shows one steady "offline" notice instead of a storm
of timeouts, and reconnects by itself when the server comes back. `arequest` is the same on
httpx's async client, for fleets that poll every server at once (console.sources.fleet).

A server is not trusted to answer well: every answer must arrive whole within a total
deadline (httpx's timeout is per read, which a server trickling a byte a second never
trips) and fit in a size cap, and it is read uncompressed, so it cannot inflate past the cap.
An answer the source cannot use (`failed`) backs off the same way as one that never came.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

import httpx

from console.sources.base import SourceError

FIRST_DELAY_S = 0.5
MAX_DELAY_S = 10.0
TIMEOUT_S = 2.0  # per read, and to connect
DEADLINE_S = 5.0  # for the whole answer
MAX_ANSWER_BYTES = 32 << 20  # a /metrics is ~100 KB; 5,000 slow queries a few MB
IDENTITY = {"Accept-Encoding": "identity"}


class Remote:
    def __init__(self, url: str, *, headers: dict[str, str] | None = None,
                 timeout: float = TIMEOUT_S, deadline: float = DEADLINE_S,
                 max_bytes: int = MAX_ANSWER_BYTES,
                 clock: Callable[[], float] = time.monotonic,
                 timer: Callable[[], float] = time.monotonic,
                 transport: httpx.BaseTransport | None = None) -> None:
        """`clock` paces the back-off; `timer` measures one answer against the deadline."""
        self.url = url.rstrip("/")
        headers = {**IDENTITY, **(headers or {})}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout,
                                   transport=transport)
        self.headers, self.timeout, self.transport = headers, timeout, transport
        self.deadline, self.max_bytes, self.timer = deadline, max_bytes, timer
        # an in-memory transport (httpx.MockTransport serves both clients) reaches the fleet too
        self.atransport = transport if isinstance(transport, httpx.AsyncBaseTransport) else None
        self.aclient: httpx.AsyncClient | None = None  # made on the fleet's event loop
        self.clock = clock
        self.online = False  # until the first answer
        self.last_error = ""
        self.delay_s = 0.0
        self.next_attempt = 0.0

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """The response (any status below 500), read whole; SourceError while the server is
        unreachable, or when its answer is late, too large or compressed."""
        self._check_backoff()
        if self.client.is_closed:  # closed by the watchdog of an earlier, late request
            self.client = httpx.Client(base_url=self.url, headers=self.headers,
                                       timeout=self.timeout, transport=self.transport)
        started = self.timer()
        # Headers that trickle never reach the per-chunk check below: past the deadline the
        # watchdog closes the client, which ends the blocked read at once.
        watchdog = threading.Timer(self.deadline + self.timeout, self.client.close)
        watchdog.daemon = True
        watchdog.start()
        try:
            with self.client.stream(method, path, **kwargs) as response:
                self._check_head(response)
                body = _read_already(response)
                if body is None:
                    body = bytearray()
                    for chunk in response.iter_raw():
                        body += chunk
                        self._check_progress(body, started)
        except (httpx.HTTPError, RuntimeError) as exc:  # RuntimeError: closed under us
            if self.client.is_closed:
                raise self.failed(f"no whole answer within {self.deadline:g} s") from exc
            raise self.failed(_describe(exc)) from exc
        finally:
            watchdog.cancel()
        return self._answered(_whole(response, body))

    async def arequest(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """`request` on the async client (created on the first call, on the caller's loop)."""
        self._check_backoff()
        if self.aclient is None:
            self.aclient = httpx.AsyncClient(base_url=self.url, headers=self.headers,
                                             timeout=self.timeout, transport=self.atransport)
        started = self.timer()
        try:
            async with asyncio.timeout(self.deadline + self.timeout):  # silence, too
                async with self.aclient.stream(method, path, **kwargs) as response:
                    self._check_head(response)
                    body = _read_already(response)
                    if body is None:
                        body = bytearray()
                        async for chunk in response.aiter_raw():
                            body += chunk
                            self._check_progress(body, started)
        except httpx.HTTPError as exc:
            raise self.failed(_describe(exc)) from exc
        except TimeoutError:
            raise self.failed(f"no whole answer within {self.deadline:g} s") from None
        return self._answered(_whole(response, body))

    def _check_head(self, response: httpx.Response) -> None:
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":
            raise self.failed(f"answered with Content-Encoding {encoding[:40]!r} though asked "
                              "for identity")
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            raise self._too_large()

    def _check_progress(self, body: bytearray, started: float) -> None:
        if len(body) > self.max_bytes:
            raise self._too_large()
        if self.timer() - started > self.deadline:
            raise self.failed(f"no whole answer within {self.deadline:g} s (it trickled "
                              f"{len(body)} bytes)")

    def _too_large(self) -> SourceError:
        return self.failed(f"answered more than {self.max_bytes} bytes")

    def _check_backoff(self) -> None:
        if not self.online and self.clock() < self.next_attempt:
            raise self._offline()

    def _answered(self, response: httpx.Response) -> httpx.Response:
        if response.status_code >= 500:
            raise self.failed(f"HTTP {response.status_code} {error_message(response)}")
        self.online, self.last_error, self.delay_s = True, "", 0.0
        return response

    def failed(self, error: str) -> SourceError:
        """Mark the server down for `error` and back off; the error to raise."""
        self.online = False
        self.last_error = error
        self.delay_s = min(MAX_DELAY_S, self.delay_s * 2 or FIRST_DELAY_S)
        self.next_attempt = self.clock() + self.delay_s
        return self._offline()

    def _offline(self) -> SourceError:
        return SourceError(f"{self.url} is offline ({self.last_error}); reconnecting with backoff")

    async def aclose(self) -> None:
        if self.aclient is not None:
            await self.aclient.aclose()

    def close(self) -> None:
        self.client.close()


def bearer(token: str | None) -> dict[str, str]:
    """The Authorization header for `token`; none without one."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def _read_already(response: httpx.Response) -> bytearray | None:
    """The body an in-process transport (httpx.MockTransport) handed over whole, else None."""
    try:
        return bytearray(response.content)
    except httpx.ResponseNotRead:
        return None


def _whole(response: httpx.Response, body: bytearray) -> httpx.Response:
    """The streamed response with its body, as a plain response reads."""
    return httpx.Response(response.status_code, headers=response.headers, content=bytes(body),
                          request=response.request)


def _describe(exc: httpx.HTTPError) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def error_message(response: httpx.Response) -> str:
    """The server's own words: `error.message` of an OpenAI-style body, else the text."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:200]
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", ""))
    return response.text.strip()[:200]


class RemoteBacked:
    """What every HTTP-backed source shares: its name (offline marked), whether the server
    answered last time and why not, and closing."""

    remote: Remote
    label: ClassVar[str]  # "attach", "vLLM": what kind of server the URL is

    @property
    def name(self) -> str:
        return f"{self.label} {self.remote.url}" + ("" if self.remote.online else " (offline)")

    @property
    def online(self) -> bool:
        return self.remote.online

    @property
    def last_error(self) -> str:
        return self.remote.last_error

    def close(self) -> None:
        self.remote.close()
