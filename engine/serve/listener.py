"""The HTTP server's listening socket, made so that accepted connections get TCP_NODELAY."""

from __future__ import annotations

import socket

BACKLOG = 2048


def listen(host: str, port: int, *, nodelay: bool = True, backlog: int = BACKLOG) -> socket.socket:
    """A bound, listening TCP socket; `nodelay=False` reproduces the old behaviour (benchmarks)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if not nodelay:
        return socket.create_server((host, port), family=family, backlog=backlog)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock
