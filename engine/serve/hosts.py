"""The Host allow-list: a defence against DNS rebinding (loopback and the operator's names only)."""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from engine.serve.protocol import ApiError

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
ANY_HOST = "*"


def host_name(value: str) -> str:
    """`value` without its port, lower-case, IPv6 addresses in brackets: "[::1]:80" -> "[::1]"."""
    value = value.strip().lower().rstrip(".")
    if value.startswith("["):
        return value.partition("]")[0] + "]"
    if value.count(":") > 1:
        return f"[{value}]"
    return value.partition(":")[0].rstrip(".")


class HostAllowList:
    """ASGI middleware: 400 for an HTTP request whose Host is not allowed."""

    def __init__(self, app: ASGIApp, allowed: Iterable[str]) -> None:
        self.app = app
        self.allowed = frozenset(host_name(host) for host in allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and ANY_HOST not in self.allowed:
            given = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if host_name(given) not in self.allowed:
                shown = given.encode("ascii", "backslashreplace").decode()[:100]
                error = ApiError(400, f"Host {shown!r} is not allowed; connect through "
                                      f"{' or '.join(sorted(self.allowed))}, or start the "
                                      "server with --allow-host NAME")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
