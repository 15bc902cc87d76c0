"""The listening socket of the HTTP server, made so that accepted connections get TCP_NODELAY.

asyncio sets TCP_NODELAY on a connection only when its socket's protocol is IPPROTO_TCP, and
`socket.create_server` makes sockets with protocol 0, so every connection accepted from one
kept Nagle's algorithm: each response after the first on a keep-alive connection waited ~40 ms
for the client's delayed ACK. Naming the protocol fixes it for every accepted socket (they
inherit it); the option is also set on the listener, which Linux copies to accepted sockets.
"""

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
