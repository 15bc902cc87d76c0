"""Keep-alive latency: a 1-token completion sent as the second request on one connection.

Without TCP_NODELAY on accepted sockets, every response after the first
on a keep-alive connection waited for the client's delayed ACK (~40 ms on Linux). This starts
the real app (synthetic:tiny on CPU) on loopback twice, with the fix (the listener of
engine.serve.listener) and without it (`socket.create_server`, what `tokenflow serve` used),
and for each of --trials fresh connections times the second request: a 1-token completion,
and a stream's first token. Prints one JSON object.

    PYTHONPATH=. .venv/bin/python benchmarks/keepalive_latency.py [--trials 50] [--mode both]
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import sys
import time

from engine import Engine, EngineConfig
from engine.serve.app import create_app
from engine.serve.loop import EngineLoop
from engine.serve.thread import ServerThread

BODY = json.dumps({"prompt": [5, 6, 7, 8], "max_tokens": 1, "ignore_eos": True}).encode()
STREAM_BODY = json.dumps({"prompt": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True,
                          "stream": True}).encode()
HEADERS = {"Content-Type": "application/json"}


def second_request_ms(host: str, port: int, body: bytes, first_token: bool) -> float:
    """Open a connection, send one warm-up request, then time the second one: the whole
    response, or up to the first SSE data line when `first_token`."""
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=BODY, headers=HEADERS)
        conn.getresponse().read()
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", body=body, headers=HEADERS)
        response = conn.getresponse()
        if first_token:
            while not response.readline().startswith(b"data: "):
                pass
            elapsed = time.perf_counter() - start
            response.read()
        else:
            response.read()
            elapsed = time.perf_counter() - start
        if response.status != 200:
            raise SystemExit(f"HTTP {response.status} from the server")
        assert conn.sock is not None, "the server closed the keep-alive connection"
        return elapsed * 1e3
    finally:
        conn.close()


def summary(values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=10, method="inclusive")
    return {"p50": round(statistics.median(values), 2), "p90": round(cuts[8], 2),
            "min": round(min(values), 2), "max": round(max(values), 2)}


def measure(loop: EngineLoop, nodelay: bool, trials: int) -> dict[str, object]:
    with ServerThread(create_app(loop, admin_token=None), nodelay=nodelay) as server:
        host, port = server.url.removeprefix("http://").split(":")
        completion = [second_request_ms(host, int(port), BODY, False) for _ in range(trials)]
        stream = [second_request_ms(host, int(port), STREAM_BODY, True) for _ in range(trials)]
        check = http.client.HTTPConnection(host, int(port))
        check.request("GET", "/health")
        check.getresponse().read()
        accepted = next(iter(server.server.server_state.connections))
        sock = accepted.transport.get_extra_info("socket")
        nodelay_set = bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        check.close()
    return {"tcp_nodelay_on_accepted_socket": nodelay_set,
            "second_request_1_token_completion_ms": summary(completion),
            "second_request_stream_first_token_ms": summary(stream)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50, help="connections per setting")
    parser.add_argument("--mode", choices=["both", "fixed", "unfixed"], default="both",
                        help="'unfixed' disables the fix: a listener from socket.create_server")
    args = parser.parse_args()
    if args.trials < 2:
        parser.error("--trials must be at least 2")
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32"))
    loop = EngineLoop(engine).start()
    try:
        result: dict[str, object] = {"trials": args.trials}
        if args.mode in ("both", "fixed"):
            result["with_fix"] = measure(loop, True, args.trials)
        if args.mode in ("both", "unfixed"):
            result["without_fix"] = measure(loop, False, args.trials)
    finally:
        loop.stop()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
