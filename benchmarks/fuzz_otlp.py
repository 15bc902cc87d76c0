"""Fuzz the trace receiver of a real `tokenflow serve --otlp-listen` with hostile exports.

It seeds a temporary store with --own engine slow queries (the server's own, source NULL),
starts `tokenflow serve` (synthetic:tiny on CPU) with an OTLP token and a roofline estimate
(so every good span is scored, and slow), measures its idle RSS, then posts --exports
exports over one keep-alive connection, each drawn at random from: random bytes, a mutated
valid export, a gzip bomb, a raw body past the cap, a broken gzip stream, an export of more
spans than the cap, spans with absurd figures (NaN, inf, 1e300, -2^63, year 2540), spans
whose ids and service names hold markup or terminal escapes, a mix of good and bad spans
(its good ids remembered when it is answered 200), a missing or wrong token, a foreign
Host, an unknown Content-Encoding, and protobuf nested past the parser's limit. RSS is
sampled as it goes. At the end: the server must be alive (and /health answers), no answer
may be 5xx, every good span of an accepted mixed export must be stored, the store's traced
rows must be within their retention caps, and the server's own slow queries intact. Prints
one JSON object; exit status 1 when any of that fails.

    PYTHONPATH=. .venv/bin/python benchmarks/fuzz_otlp.py [--exports 10000] [--seed 0]

With --console the receiver is `tokenflow-console --attach URL --otlp-listen` in a tmux pane
(attached to a `tokenflow serve`): it must still run at the end, its pane title must be
unchanged and no traceback on its screen.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from sqlalchemy import func, select

from benchmarks.http_load import free_port
from engine.serve.otlp import PROTOBUF
from engine.serve.otlp_limits import OtlpLimits
from engine.store import RetentionLimits, open_database
from engine.store.models import SlowQueryRow, TracedRequestRow

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "fuzz-otlp-token"
RSS_EVERY = 100  # exports between two RSS samples
LIMITS = OtlpLimits()
ABSURD: list[object] = [float("nan"), float("inf"), float("-inf"), 1e300, -1e300, -(2**63),
                        2**63 - 1, -1, 1.5, True, "12", "", 10**18]
HOSTILE_TEXT = ["[/]", "[bold red]x", "\x1b]0;owned\x07", "\x1b[2J", "a\u202eb", "x" * 200,
                "\x00", "\ud7ff\ue000", "[link=http://evil]x[/link]"]
BOMB = gzip.compress(b"\0" * (256 << 20), compresslevel=9)  # 256 MB in ~250 KB


def value(raw: object) -> AnyValue:
    if isinstance(raw, str):
        return AnyValue(string_value=raw)
    if isinstance(raw, bool):
        return AnyValue(bool_value=raw)
    if isinstance(raw, int) and -(2**63) <= raw < 2**63:
        return AnyValue(int_value=raw)
    return AnyValue(double_value=float(raw))  # type: ignore[arg-type]


def span(request_id: str, **figures: object) -> Span:
    attrs = {"gen_ai.request.id": request_id, "gen_ai.usage.prompt_tokens": 200,
             "gen_ai.usage.completion_tokens": 20, "gen_ai.latency.time_in_model_prefill": 0.05,
             "gen_ai.latency.time_to_first_token": 0.06, "gen_ai.latency.e2e": 1.0,
             "gen_ai.latency.time_in_queue": 0.01, "gen_ai.latency.time_in_model_decode": 0.9,
             **figures}
    return Span(name="llm_request", start_time_unix_nano=nanos(figures.get("start")),
                attributes=[KeyValue(key=k, value=value(v)) for k, v in attrs.items()
                            if k != "start"])


def nanos(start: object) -> int:
    """A start time as the wire holds one (uint64 ns), absurd ones pinned to its ends."""
    if start is None:
        return int((time.time() - 5) * 1e9)
    try:
        seconds = float(start)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0
    if seconds != seconds or seconds <= 0:
        return 0
    return min(2**64 - 1, int(min(seconds, 1.9e10) * 1e9))


def export(spans: list[Span], service: str = "fuzz-vllm") -> bytes:
    message = ExportTraceServiceRequest()
    resource = message.resource_spans.add()
    resource.resource.attributes.append(KeyValue(key="service.name", value=value(service)))
    resource.scope_spans.add().spans.extend(spans)
    return message.SerializeToString()


def nested(depth: int) -> bytes:
    """An export whose one attribute nests `depth` arrays deep, written by hand on the wire
    (the protobuf library itself refuses to build one past its depth limit)."""
    def field(number: int, payload: bytes) -> bytes:  # a length-delimited field
        size, length = bytearray(), len(payload)
        while True:
            size.append((length & 0x7F) | (0x80 if length > 0x7F else 0))
            length >>= 7
            if not length:
                return bytes([number << 3 | 2]) + bytes(size) + payload

    inner = AnyValue(string_value="deep").SerializeToString()
    for _ in range(depth):  # AnyValue.array_value (5) holding ArrayValue.values (1)
        inner = field(5, field(1, inner))
    attribute = field(1, b"deep") + field(2, inner)  # KeyValue
    return field(1, field(1, field(1, attribute)))  # resource_spans.resource.attributes


class Fuzzer:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.serial = 0
        self.expected: set[str] = set()  # good ids of accepted mixed exports

    def good_id(self) -> str:
        self.serial += 1
        return f"good-{self.serial}"

    def draw(self) -> tuple[str, bytes, dict[str, str], list[str]]:
        """(kind, body, headers, good ids the body holds)."""
        rng = self.rng
        headers = {"Content-Type": PROTOBUF, "Authorization": f"Bearer {TOKEN}"}
        kind = rng.choice(["random", "mutated", "bomb", "huge", "broken_gzip", "span_flood",
                           "absurd", "hostile_text", "mixed", "mixed", "mixed", "no_token",
                           "wrong_token", "host", "encoding", "nested"])
        good: list[str] = []
        if kind == "random":
            body = rng.randbytes(rng.randrange(1, 4096))
        elif kind == "mutated":
            data = bytearray(export([span(f"m{rng.random()}") for _ in range(3)]))
            for _ in range(rng.randrange(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            body = bytes(data)
        elif kind == "bomb":
            body, headers["Content-Encoding"] = BOMB, rng.choice(["gzip", "GZIP", "Gzip"])
        elif kind == "huge":
            body = b"\x0a" * (LIMITS.max_body_bytes + rng.randrange(1, 1 << 20))
        elif kind == "broken_gzip":
            whole = gzip.compress(export([span(f"b{rng.random()}")]))
            body, headers["Content-Encoding"] = whole[:rng.randrange(1, len(whole))], "gzip"
        elif kind == "span_flood":
            body = export([span(f"f{i}") for i in range(LIMITS.max_spans + 1)])
        elif kind == "absurd":
            key = rng.choice(["gen_ai.usage.prompt_tokens", "gen_ai.usage.completion_tokens",
                              "gen_ai.latency.time_in_model_prefill", "gen_ai.latency.e2e",
                              "start"])
            body = export([span(f"a{rng.random()}", **{key: rng.choice([*ABSURD, 1.8e10])})])
        elif kind == "hostile_text":
            text = rng.choice(HOSTILE_TEXT)
            body = export([span(text)], service=rng.choice([text, "fuzz-vllm"]))
        elif kind == "mixed":
            spans = []
            for _ in range(rng.randrange(2, 12)):
                if rng.random() < 0.6:
                    good.append(self.good_id())
                    spans.append(span(good[-1]))
                else:
                    spans.append(span(rng.choice(HOSTILE_TEXT[2:]),
                                      **{"gen_ai.usage.prompt_tokens": rng.choice(ABSURD)}))
            body = export(spans)
            if rng.random() < 0.5:
                body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
        elif kind in ("no_token", "wrong_token"):
            body = export([span(f"t{rng.random()}")])
            if kind == "no_token":
                del headers["Authorization"]
            else:
                headers["Authorization"] = rng.choice(["Bearer guess", "Basic x", TOKEN, ""])
        elif kind == "host":
            body = export([span(f"h{rng.random()}")])
            headers["Host"] = rng.choice(["evil.example", "127.0.0.1.evil.example", "x" * 300])
        elif kind == "encoding":
            body = export([span(f"e{rng.random()}")])
            headers["Content-Encoding"] = rng.choice(["br", "deflate", "gzip, gzip", "x" * 100])
        else:
            body = nested(rng.choice([50, 120, 500]))
        return kind, body, headers, good


def seed_store(path: Path, own: int) -> None:
    database = open_database(path)
    try:
        with database.session() as session, session.begin():
            session.add_all(SlowQueryRow(
                created_at=time.time(), request_id=f"own-{i}", tenant="default", tag=None,
                budget_score=9.0, prompt_tokens=100, prefill_s=1.0, budgeted_s=0.1, chunks=[],
                config={}, source=None) for i in range(own))
    finally:
        database.close()


@dataclass
class Receiver:
    """The process under test, its OTLP URL, and how to tell it still runs."""

    process: psutil.Process
    url: str
    alive: Callable[[], bool]
    close: Callable[[], None]
    report: Callable[[], dict[str, object]] = dict


def serve_receiver(db: Path, otlp_port: int) -> Receiver:
    """`tokenflow serve --otlp-listen`, scoring every span against an H200 roofline."""
    server, url = start_serve(db, "--otlp-listen", f"127.0.0.1:{otlp_port}",
                              "--roofline-model", "synthetic:tiny", "--gpu", "h200")
    httpx.get(f"{url}/health", timeout=30)

    def close() -> None:
        if server.poll() is None:
            server.terminate()
            server.wait(60)

    return Receiver(psutil.Process(server.pid), f"http://127.0.0.1:{otlp_port}/v1/traces",
                    lambda: server.poll() is None and httpx.get(f"{url}/health",
                                                                timeout=30).status_code == 200,
                    close)


def console_receiver(db: Path, otlp_port: int, tmp: Path) -> Receiver:
    """`tokenflow-console --attach URL --otlp-listen` in a tmux pane, attached to a serve."""
    server, url = start_serve(None, "--public-stats")
    tmux = ["tmux", "-L", f"fuzz-otlp-{os.getpid()}", "-f", "/dev/null"]
    command = (f"exec env PYTHONPATH={ROOT} TOKENFLOW_OTLP_TOKEN={TOKEN} {sys.executable} -m "
               f"console.cli.console --attach {url} --otlp-listen 127.0.0.1:{otlp_port} "
               f"--roofline-model synthetic:tiny --gpu h200 --db {db} 2>{tmp / 'console.err'}")
    subprocess.run([*tmux, "new-session", "-d", "-s", "fuzz", "-x", "160", "-y", "50",
                    command], check=True, cwd=ROOT)
    pid = int(subprocess.run([*tmux, "display", "-p", "-t", "fuzz", "#{pane_pid}"],
                             capture_output=True, text=True, check=True).stdout)
    deadline = time.monotonic() + 120
    while True:  # a child starting: nothing to wait on but its port
        try:
            socket.create_connection(("127.0.0.1", otlp_port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or not psutil.pid_exists(pid):
                raise SystemExit(f"the console did not start: "
                                 f"{(tmp / 'console.err').read_text()[-2000:]}") from None
            time.sleep(0.2)
    title = pane(tmux, "#{pane_title}")

    def alive() -> bool:
        return psutil.pid_exists(pid) and subprocess.run(
            [*tmux, "has-session", "-t", "fuzz"], capture_output=True).returncode == 0

    def close() -> None:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
        server.terminate()
        server.wait(60)

    def report() -> dict[str, object]:
        screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", "fuzz"],
                                capture_output=True, text=True).stdout
        return {"pane_title_unchanged": pane(tmux, "#{pane_title}") == title,
                "traceback_on_screen": "Traceback" in screen}

    return Receiver(psutil.Process(pid), f"http://127.0.0.1:{otlp_port}/v1/traces", alive,
                    close, report)


def pane(tmux: list[str], field: str) -> str:
    return subprocess.run([*tmux, "display", "-p", "-t", "fuzz", field], capture_output=True,
                          text=True).stdout.strip()


def start_serve(db: Path | None, *flags: str) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENFLOW_OTLP_TOKEN": TOKEN}
    store = ["--db", str(db)] if db is not None else ["--no-db"]
    server = subprocess.Popen(
        [sys.executable, "-m", "console.cli.main", "serve", "--model", "synthetic:tiny",
         "--device", "cpu", "--dtype", "float32", "--port", "0", *store, *flags], cwd=ROOT,
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stderr is not None
    banner = server.stdout.readline()  # printed once every listener is up
    found = re.search(r"(http://[\d.]+:\d+),", banner)
    if not found:
        raise SystemExit(f"serve did not start: {banner}{server.stderr.read()[-2000:]}")
    for stream in (server.stdout, server.stderr):  # its logs must never fill a pipe
        threading.Thread(target=stream.read, daemon=True).start()
    return server, found.group(1)


def counts(db: Path) -> dict[str, int]:
    database = open_database(db, read_only=True)
    try:
        with database.session() as session:
            def count(*where: object, table: type = SlowQueryRow) -> int:
                return session.scalar(select(func.count()).select_from(table).where(*where))

            return {"traced_requests": count(table=TracedRequestRow),
                    "traced_slow_queries": count(SlowQueryRow.source.is_not(None)),
                    "own_slow_queries": count(SlowQueryRow.source.is_(None))}
    finally:
        database.close()


def stored_ids(db: Path, ids: set[str]) -> set[str]:
    database = open_database(db, read_only=True)
    try:
        with database.session() as session:
            found = set()
            listed = sorted(ids)
            for i in range(0, len(listed), 500):
                found |= set(session.scalars(select(TracedRequestRow.request_id).where(
                    TracedRequestRow.request_id.in_(listed[i:i + 500]))))
            return found
    finally:
        database.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exports", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--own", type=int, default=50, help="own slow queries seeded")
    parser.add_argument("--console", action="store_true",
                        help="fuzz tokenflow-console --otlp-listen in a tmux pane instead")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    fuzzer = Fuzzer(rng)
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "fuzz.db"
        seed_store(db, args.own)
        otlp_port = free_port()
        receiver = (console_receiver(db, otlp_port, Path(tmp)) if args.console
                    else serve_receiver(db, otlp_port))
        statuses: Counter[str] = Counter()
        by_kind: Counter[str] = Counter()
        server_errors: list[str] = []
        transport_errors: list[str] = []
        rejected_spans = 0
        try:
            with httpx.Client(timeout=60) as http:
                idle_rss = receiver.process.memory_info().rss
                peak_rss = idle_rss
                started = time.monotonic()
                for index in range(args.exports):
                    kind, body, headers, good = fuzzer.draw()
                    try:
                        response = http.post(receiver.url, content=body, headers=headers)
                    except httpx.HTTPError as exc:
                        transport_errors.append(f"{kind}: {type(exc).__name__}: {exc}")
                        continue
                    statuses[str(response.status_code)] += 1
                    by_kind[f"{kind} {response.status_code}"] += 1
                    if response.status_code >= 500:
                        server_errors.append(f"{kind}: {response.text[:200]}")
                    if response.status_code == 200:
                        answer = ExportTraceServiceResponse.FromString(response.content)
                        rejected_spans += answer.partial_success.rejected_spans
                        fuzzer.expected.update(good)
                    if index % RSS_EVERY == 0:
                        peak_rss = max(peak_rss, receiver.process.memory_info().rss)
                elapsed = time.monotonic() - started
                peak_rss = max(peak_rss, receiver.process.memory_info().rss)
                final_rss = receiver.process.memory_info().rss
            alive = receiver.alive()
            extra = receiver.report()
        finally:
            receiver.close()
        figures = counts(db)
        missing = fuzzer.expected - stored_ids(db, fuzzer.expected)
        caps = RetentionLimits()
        size = db.stat().st_size
    result = {
        "exports": args.exports, "seconds": round(elapsed, 1),
        "exports_per_s": round(args.exports / elapsed, 1),
        "statuses": dict(statuses), "by_kind": dict(sorted(by_kind.items())),
        "target": "console in tmux" if args.console else "tokenflow serve",
        "alive": alive, "server_errors": server_errors[:20], **extra,
        "transport_errors": transport_errors[:20], "rejected_spans": rejected_spans,
        "rss_idle_mb": round(idle_rss / 2**20, 1), "rss_peak_mb": round(peak_rss / 2**20, 1),
        "rss_final_mb": round(final_rss / 2**20, 1),
        "rss_peak_over_idle": round(peak_rss / idle_rss, 2),
        "store": {**figures, "bytes": size, "caps": {
            "traced_requests": caps.traced_requests,
            "traced_slow_queries": caps.traced_slow_queries}},
        "good_spans_accepted": len(fuzzer.expected), "good_spans_missing": len(missing),
        "own_slow_queries_seeded": args.own,
    }
    failed = (not alive or server_errors or transport_errors or missing
              or extra.get("pane_title_unchanged") is False or extra.get("traceback_on_screen")
              or figures["traced_requests"] > caps.traced_requests
              or figures["traced_slow_queries"] > caps.traced_slow_queries
              or figures["own_slow_queries"] != args.own
              or peak_rss > 1.5 * idle_rss)
    result["ok"] = not failed
    print(json.dumps(result, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
