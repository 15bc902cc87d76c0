"""How long a newcomer's GET waits at the file limit: a server whose file limit is 24
descriptors above its use (tests/test_hostile_inputs.py's FILE_LIMITED_SERVER, with the
default 10 s header deadline) is held by 60 idle connections, then one GET is timed.
Prints one JSON object.

    PYTHONPATH=. .venv/bin/python benchmarks/file_limit.py [--tries 3]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.test_hostile_inputs import FILE_LIMITED_SERVER

ROOT = Path(__file__).resolve().parents[1]


def one() -> float:
    code = FILE_LIMITED_SERVER.replace("header_timeout_s=600.0", "header_timeout_s=10.0")
    server = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    idle: list[socket.socket] = []
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(60)]
        time.sleep(0.5)  # every one accepted or refused by now
        started = time.perf_counter()
        client = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        client.request("GET", "/")
        client.getresponse().read()
        return time.perf_counter() - started
    finally:
        for sock in idle:
            sock.close()
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=3)
    args = parser.parse_args()
    waits = [round(one(), 3) for _ in range(args.tries)]
    print(json.dumps({"newcomer_s": waits, "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
