"""Fuzz a real `tokenflow serve`: N hostile bodies while a steady
client sends normal requests.

It starts `tokenflow serve` (synthetic:tiny on CPU, a temporary store, an admin token) in a
child process. One sender posts --bodies bodies over one keep-alive connection: half drawn by
hypothesis from tests/test_fuzz.py's strategies (poison values among them), half built here at
random (valid requests, fields set to hostile values, every hand-written poison of
tests/test_server_edge.py, truncated JSON, random bytes, wrong Content-Types and Hosts, admin
PATCHes). Meanwhile a steady client sends normal requests, each of which must come back with
all its tokens. Then each of the two requests that used to kill the engine is followed by
--followers normal requests, and the server is restarted on the same store, which must hold
no request to resume (all finished before a SIGTERM). Prints one JSON object; exit status 1
on any engine death, 5xx, transport error or failed normal request.

    PYTHONPATH=. .venv/bin/python benchmarks/fuzz_server.py [--bodies 10000] [--seed 0]
    PYTHONPATH=. .venv/bin/python benchmarks/fuzz_server.py --attacks [--attack file_limit]

With --attacks it instead replays each attack that once took the server down (one request's
n, stop strings, logit_bias and answer size; unread streams; trickled bodies; the file
limit) beside a bystander, against RSS and bystander-p99 bounds (benchmarks/fuzz_attacks.py).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from sqlalchemy import select

from benchmarks.http_load import free_port, wait_ready
from engine.config import SamplingParams
from engine.store import open_database, unfinished_requests
from engine.store.models import JournalRow
from tests.test_fuzz import bodies, config_bodies
from tests.test_server_edge import KILLERS, POISON

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "fuzz-admin-token"
VOCAB = 320  # synthetic:tiny
HEALTH_EVERY = 250  # bodies between two /health checks
JSON_TYPE = "application/json"
# Values a hostile client tries in any field.
NASTY: list[object] = [
    None, True, False, 0, -1, 1, 2, 0.5, -0.5, 1e-46, 7e-46, 1e-38, 1e308, -1e308,
    float("nan"), float("inf"), float("-inf"), 2**31, 2**63 - 1, 2**63, 2**64, 2**70,
    -(2**63) - 1, 10**400, "", "x", "\ud800", "\udfff\ud800", "1", [], [1], [-5], [2**70], {},
    {"a": 1}, [[1, 2]], [["x"]], "A" * 300,
]
FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop_token_ids",
          "stream", "stream_options", "model", "n", "best_of", "echo", "logprobs", "stop",
          "suffix", "user", "prompt"]
SANE: dict[str, list[object]] = {
    "max_tokens": [1, 2, 4, 8], "temperature": [0, 0.7, 1.0, 1.5], "top_p": [0.1, 0.9, 1.0],
    "top_k": [0, 1, 20, VOCAB], "seed": [0, 7, 2**64 - 1, -(2**63)], "ignore_eos": [True, False],
    "stop_token_ids": [[], [3], [VOCAB - 1]], "stream": [True, False],
    "stream_options": [{"include_usage": True}], "model": ["synthetic:tiny"], "n": [1],
}
CONTENT_TYPES = ["text/plain", "application/x-www-form-urlencoded", "", "application/jsonx",
                 "multipart/form-data; boundary=x", "APPLICATION/JSON; charset=utf-8"]
HOSTS = ["evil.example", "127.0.0.1.evil.example", "localhost.", "[::1]", "", "x" * 300]


@dataclass
class Tally:
    status: Counter[str] = field(default_factory=Counter)
    by_source: Counter[str] = field(default_factory=Counter)
    transport_errors: list[str] = field(default_factory=list)
    server_errors: list[str] = field(default_factory=list)
    kept_alive_refusals: int = 0
    closed_on_refusal: list[str] = field(default_factory=list)
    engine_deaths: int = 0


class Client:
    """One keep-alive connection (http.client reopens it after a server close)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

    def send(self, method: str, path: str, body: bytes | None,
             headers: dict[str, str]) -> tuple[int, bytes, bool]:
        """(status, body, whether the connection stays open); reconnects on a transport error."""
        try:
            self.conn.request(method, path, body=body, headers=headers)
            response = self.conn.getresponse()
            return response.status, response.read(), not response.will_close
        except (OSError, http.client.HTTPException):
            self.conn.close()
            raise


def random_body(rng: random.Random) -> tuple[str, str, bytes, dict[str, str]]:
    """(kind, path, body, headers) of one hostile or valid request."""
    headers = {"Content-Type": JSON_TYPE}
    roll = rng.random()
    if roll < 0.10:
        body, _field = rng.choice(POISON)
        return "poison", "/v1/completions", body, headers
    if roll < 0.15:
        return "bytes", "/v1/completions", rng.randbytes(rng.randint(0, 200)), headers
    if roll < 0.20:
        changes = {rng.choice(["tenant_shares", "tenant_priorities", "chunk_tile",
                               "guard_window_s", "max_num_batched_tokens", "auto_budget"]):
                   rng.choice([*NASTY, {"a": rng.choice(NASTY)}])}
        return ("admin", "/v1/admin/config", json.dumps(changes).encode(),
                {**headers, "Authorization": f"Bearer {TOKEN}"})
    prompt: object = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
    if rng.random() < 0.3:
        prompt = rng.choice(["hello", "\ud800", [prompt], *NASTY])
    request: dict[str, object] = {"prompt": prompt, "max_tokens": rng.randint(1, 8)}
    for name in rng.sample(FIELDS, rng.randint(0, 4)):
        request[name] = rng.choice(NASTY if rng.random() < 0.6 else SANE.get(name, NASTY))
    raw = json.dumps(request).encode()
    if rng.random() < 0.05:
        raw = raw[:rng.randint(0, len(raw))]
    if rng.random() < 0.03:
        headers["Content-Type"] = rng.choice(CONTENT_TYPES)
    if rng.random() < 0.02:
        headers["Host"] = rng.choice(HOSTS)
    return "random", "/v1/completions", raw, headers


def record(tally: Tally, client: Client, kind: str, method: str, path: str, body: bytes,
           headers: dict[str, str]) -> None:
    tally.by_source[kind] += 1
    try:
        status, reply, kept = client.send(method, path, body, headers)
    except (OSError, http.client.HTTPException) as exc:
        tally.transport_errors.append(f"{type(exc).__name__}: {exc} for {body[:120]!r}")
        return
    tally.status[str(status)] += 1
    if status >= 500:
        tally.server_errors.append(f"HTTP {status} {reply[:200]!r} for {body[:120]!r}")
    elif status >= 400 and status != 408:
        if kept:
            tally.kept_alive_refusals += 1
        else:
            tally.closed_on_refusal.append(f"HTTP {status} for {body[:120]!r}")
    if tally.status.total() % HEALTH_EVERY == 0:
        check_health(tally, client)


def check_health(tally: Tally, client: Client) -> None:
    try:
        status, _reply, _kept = client.send("GET", "/health", None, {})
    except (OSError, http.client.HTTPException):
        status = 0
    if status != 200:
        tally.engine_deaths += 1


@dataclass
class Steady:
    """Normal requests in a loop until stopped; each must return all its tokens."""

    port: int
    sent: int = 0
    completed: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        client = Client(self.port)
        rng = random.Random(1)
        while not self.stop.is_set():
            self.one(client, rng)

    def one(self, client: Client, rng: random.Random) -> bool:
        max_tokens = rng.randint(1, 8)
        body = json.dumps({"prompt": [rng.randrange(VOCAB) for _ in range(rng.randint(1, 16))],
                           "max_tokens": max_tokens, "ignore_eos": True}).encode()
        self.sent += 1
        try:
            status, reply, _kept = client.send("POST", "/v1/completions", body,
                                               {"Content-Type": JSON_TYPE})
        except (OSError, http.client.HTTPException) as exc:
            self.failures.append(f"{type(exc).__name__}: {exc}")
            return False
        if status == 200 and len(json.loads(reply)["choices"][0]["token_ids"]) == max_tokens:
            self.completed += 1
            return True
        self.failures.append(f"HTTP {status}: {reply[:200]!r}")
        return False


def start_server(port: int, db: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "console.cli.main", "serve", "--model", "synthetic:tiny",
               "--device", "cpu", "--dtype", "float32", "--port", str(port), "--db", str(db),
               "--max-model-len", "128"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENFLOW_ADMIN_TOKEN": TOKEN}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def stop_server(server: subprocess.Popen[bytes]) -> str:
    server.terminate()
    _out, err = server.communicate(timeout=60)
    return err.decode(errors="replace")


def fuzz(port: int, count: int, seed: int, tally: Tally) -> None:
    client = Client(port)
    rng = random.Random(seed)
    for _ in range(count - count // 2):
        kind, path, body, headers = random_body(rng)
        record(tally, client, kind, "PATCH" if kind == "admin" else "POST", path, body, headers)

    @settings(max_examples=count // 2, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(body=bodies | config_bodies.map(lambda raw: b"PATCH " + raw))
    def hypothesis_bodies(body: bytes) -> None:
        if body.startswith(b"PATCH "):
            record(tally, client, "hypothesis-admin", "PATCH", "/v1/admin/config", body[6:],
                   {"Content-Type": JSON_TYPE, "Authorization": f"Bearer {TOKEN}"})
        else:
            record(tally, client, "hypothesis", "POST", "/v1/completions", body,
                   {"Content-Type": JSON_TYPE})

    hypothesis_bodies()
    check_health(tally, client)


def poison_in_journal(db: Path) -> tuple[list[str], int]:
    """(unfinished requests a restart would resume, journal rows whose sampling is refused)."""
    database = open_database(db)
    try:
        with database.session() as session:
            unfinished = [f"{e.request_id} {e.state} prompt {len(e.prompt_token_ids)} "
                          f"generated {len(e.generated_token_ids)} {e.sampling}"
                          for e in unfinished_requests(session)]
            refused = 0
            for sampling in session.scalars(select(JournalRow.sampling)):
                try:
                    SamplingParams(**sampling)
                except ValueError:
                    refused += 1
    finally:
        database.close()
    return unfinished, refused


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bodies", type=int, default=10_000)
    parser.add_argument("--followers", type=int, default=100,
                        help="normal requests after each engine-killing request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attacks", action="store_true",
                        help="replay the attacks of benchmarks/fuzz_attacks.py instead")
    parser.add_argument("--attack", action="append", default=[], metavar="NAME",
                        help="with --attacks, replay only NAME (repeatable): "
                             "huge_n, stop_strings, logit_bias, big_answer, unread_streams, "
                             "body_trickle, file_limit")
    args = parser.parse_args()
    if args.attacks:
        from benchmarks.fuzz_attacks import run_attacks

        return run_attacks(only=tuple(args.attack))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tally = Tally()
    steady = Steady(port)
    killers: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "fuzz.db"
        server = start_server(port, db)
        start = time.perf_counter()
        try:
            wait_ready(url, server)
            background = threading.Thread(target=steady.run, daemon=True)
            background.start()
            fuzz(port, args.bodies, args.seed, tally)
            steady.stop.set()
            background.join(120)
            followers = Client(port)
            rng = random.Random(2)
            for body, name in KILLERS:
                status, _reply, _kept = followers.send("POST", "/v1/completions", body,
                                                       {"Content-Type": JSON_TYPE})
                ok = sum(steady.one(followers, rng) for _ in range(args.followers))
                killers[name] = f"HTTP {status}, then {ok}/{args.followers} normal requests ok"
            check_health(tally, followers)
        finally:
            server_log = stop_server(server)
        wall = time.perf_counter() - start
        exited = server.returncode
        unfinished, refused_rows = poison_in_journal(db)
        restarted = start_server(port, db)
        try:
            wait_ready(url, restarted)
            restart_ok = Steady(port).one(Client(port), random.Random(3))
        finally:
            stop_server(restarted)
    five_xx = sum(n for status, n in tally.status.items() if status.startswith("5"))
    result = {
        "bodies": tally.by_source.total(), "by_source": dict(tally.by_source),
        "status": dict(sorted(tally.status.items())), "five_xx": five_xx,
        "server_errors": tally.server_errors[:5], "transport_errors": len(tally.transport_errors),
        "transport_error_samples": tally.transport_errors[:5],
        "engine_deaths": tally.engine_deaths,
        "refusals_on_a_kept_connection": tally.kept_alive_refusals,
        "refusals_that_closed_the_connection": len(tally.closed_on_refusal),
        "closed_samples": tally.closed_on_refusal[:5],
        "steady_client": {"sent": steady.sent, "completed": steady.completed,
                          "failures": steady.failures[:5]},
        "engine_killers": killers,
        "after_restart": {"unfinished_in_journal": len(unfinished),
                          "unfinished_samples": unfinished[:5],
                          "journal_rows_with_refused_sampling": refused_rows,
                          "normal_request_ok": restart_ok},
        "server_exit_code": exited, "wall_s": round(wall, 1),
    }
    print(json.dumps(result, indent=2))
    if "Traceback" in server_log:
        print(server_log[-3000:], file=sys.stderr)
    ok = (five_xx == 0 and not tally.transport_errors and tally.engine_deaths == 0
          and steady.completed == steady.sent and refused_rows == 0 and not unfinished
          and restart_ok
          and all(f"{args.followers}/{args.followers}" in v for v in killers.values())
          and "Traceback" not in server_log)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
