"""Load on `tokenflow serve` over loopback: N requests from C concurrent httpx clients.

It starts `tokenflow serve` (synthetic:tiny on CPU, a temporary SQLite store) in a child
process, waits for /health, then C clients (each its own connection) take requests from a
shared pool: random prompts of token ids, random max_tokens with ignore_eos so every
accepted request must return exactly max_tokens tokens, a quarter of them streamed. It counts
status codes (429 is the intended answer of a full queue; the client does not retry), checks
every 200, and prints one JSON object. Exit status 1 if anything but 200 or 429 came back,
or an accepted request came back short.

    PYTHONPATH=. .venv/bin/python benchmarks/http_load.py [--requests 1000] [--concurrency 200]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from engine.stats import percentiles_ms

ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 120.0


@dataclass
class Tally:
    status: Counter[str] = field(default_factory=Counter)
    completed: int = 0
    short: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    output_tokens: int = 0


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    max_tokens: int
    stream: bool


def make_jobs(count: int, seed: int) -> list[Job]:
    rng = random.Random(seed)
    return [Job([rng.randrange(3, 259) for _ in range(rng.randint(8, 48))],
                rng.randint(4, 32), rng.random() < 0.25) for _ in range(count)]


async def run_job(http: httpx.AsyncClient, job: Job, tally: Tally) -> None:
    body = {"prompt": job.prompt, "max_tokens": job.max_tokens, "ignore_eos": True,
            "stream": job.stream}
    start = time.perf_counter()
    try:
        if job.stream:
            tokens, first = await _stream(http, body, tally)
        else:
            response = await http.post("/v1/completions", json=body)
            tally.status[str(response.status_code)] += 1
            if response.status_code != 200:
                _note_refusal(response.status_code, response.text, tally)
                return
            tokens, first = response.json()["choices"][0]["token_ids"], None
    except httpx.HTTPError as exc:
        tally.status["transport-error"] += 1
        tally.errors.append(f"{type(exc).__name__}: {exc}")
        return
    if tokens is None:
        return
    tally.latency_s.append(time.perf_counter() - start)
    if first is not None:
        tally.ttft_s.append(first - start)
    tally.output_tokens += len(tokens)
    if len(tokens) == job.max_tokens:
        tally.completed += 1
    else:
        tally.short.append(f"{len(tokens)} of {job.max_tokens} tokens")


async def _stream(http: httpx.AsyncClient, body: dict[str, object],
                  tally: Tally) -> tuple[list[int] | None, float | None]:
    tokens: list[int] = []
    first: float | None = None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        tally.status[str(response.status_code)] += 1
        if response.status_code != 200:
            _note_refusal(response.status_code, (await response.aread()).decode(), tally)
            return None, None
        done = False
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    tally.errors.append(str(chunk["error"]))
                    return None, None
                first = first or time.perf_counter()
                tokens += chunk["choices"][0]["token_ids"]
    return (tokens if done else None), first


def _note_refusal(status: int, text: str, tally: Tally) -> None:
    if status != 429:
        tally.errors.append(f"HTTP {status}: {text[:200]}")


async def drive(url: str, jobs: list[Job], concurrency: int) -> tuple[Tally, float]:
    tally = Tally()
    pending = list(reversed(jobs))

    async def client() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            while pending:
                await run_job(http, pending.pop(), tally)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return tally, time.perf_counter() - start


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int, max_queue: int, db: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "console.cli.main", "serve", "--model", "synthetic:tiny",
               "--device", "cpu", "--dtype", "float32", "--port", str(port),
               "--max-queue", str(max_queue), "--db", str(db)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def wait_ready(url: str, server: subprocess.Popen[bytes]) -> None:
    deadline, delay = time.monotonic() + STARTUP_TIMEOUT_S, 0.05
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited: {server.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(delay)  # a child process starting: nothing to wait on but its port
        delay = min(delay * 2, 0.5)
    raise SystemExit(f"the server did not answer /health within {STARTUP_TIMEOUT_S} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--max-queue", type=int, default=256,
                        help="the server's --max-queue; below --concurrency some get 429")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    jobs = make_jobs(args.requests, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(port, args.max_queue, Path(tmp) / "load.db")
        try:
            wait_ready(url, server)
            tally, wall = asyncio.run(drive(url, jobs, args.concurrency))
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
        finally:
            server.terminate()
            server.wait(30)
    accepted = tally.status["200"]
    result = {
        "requests": args.requests, "concurrency": args.concurrency,
        "max_queue": args.max_queue, "status": dict(tally.status),
        "accepted": accepted, "completed_with_all_tokens": tally.completed,
        "short": tally.short[:5], "errors": tally.errors[:5], "wall_s": round(wall, 2),
        "requests_per_s": round(args.requests / wall, 1),
        "output_tokens_per_s": round(tally.output_tokens / wall, 1),
        "latency_ms": dataclasses.asdict(percentiles_ms(tally.latency_s)),
        "stream_ttft_ms": dataclasses.asdict(percentiles_ms(tally.ttft_s)),
        "server_generation_tokens_total": _counter(metrics, "tokenflow_generation_tokens_total"),
    }
    print(json.dumps(result, indent=2))
    unexpected = set(tally.status) - {"200", "429"}
    ok = not unexpected and not tally.errors and tally.completed == accepted
    return 0 if ok else 1


def _counter(metrics: str, name: str) -> float | None:
    for line in metrics.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return None


if __name__ == "__main__":
    sys.exit(main())
