"""A remote server the console polls, and whether it is reachable right now.

After a failure the next attempt waits (0.5 s, doubling to 10 s); until then calls fail fast
with the same message, so the console shows one steady "offline" notice instead of a storm
of timeouts, and reconnects by itself when the server comes back. `arequest` is the same on
httpx's async client, for fleets that poll every server at once (console.sources.fleet).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, ClassVar

import httpx

from console.sources.base import SourceError

FIRST_DELAY_S = 0.5
MAX_DELAY_S = 10.0
TIMEOUT_S = 2.0


class Remote:
    def __init__(self, url: str, *, headers: dict[str, str] | None = None,
                 timeout: float = TIMEOUT_S, clock: Callable[[], float] = time.monotonic,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout,
                                   transport=transport)
        self.headers, self.timeout = headers, timeout
        # an in-memory transport (httpx.MockTransport serves both clients) reaches the fleet too
        self.atransport = transport if isinstance(transport, httpx.AsyncBaseTransport) else None
        self.aclient: httpx.AsyncClient | None = None  # made on the fleet's event loop
        self.clock = clock
        self.online = False  # until the first answer
        self.last_error = ""
        self.delay_s = 0.0
        self.next_attempt = 0.0

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """The response (any status below 500); SourceError while the server is unreachable."""
        self._check_backoff()
        try:
            response = self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise self._failed(_describe(exc)) from exc
        return self._answered(response)

    async def arequest(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """`request` on the async client (created on the first call, on the caller's loop)."""
        self._check_backoff()
        if self.aclient is None:
            self.aclient = httpx.AsyncClient(base_url=self.url, headers=self.headers,
                                             timeout=self.timeout, transport=self.atransport)
        try:
            response = await self.aclient.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise self._failed(_describe(exc)) from exc
        return self._answered(response)

    def _check_backoff(self) -> None:
        if not self.online and self.clock() < self.next_attempt:
            raise self._offline()

    def _answered(self, response: httpx.Response) -> httpx.Response:
        if response.status_code >= 500:
            raise self._failed(f"HTTP {response.status_code} {error_message(response)}")
        self.online, self.last_error, self.delay_s = True, "", 0.0
        return response

    def _failed(self, error: str) -> SourceError:
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
