"""The trace receiver against a hostile exporter: tokens and Host, bombs, broken gzip, slow
bodies, span floods, poison spans and retention. The caps are scaled down, so each bomb is
small and each test fast."""

from __future__ import annotations

import asyncio
import gzip
import math
import sqlite3
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from sqlalchemy import func, select
from starlette.testclient import TestClient

from engine.serve.otlp import (
    PROTOBUF,
    STORE_RETRY_S,
    PrefillEstimate,
    TraceCollector,
    create_otlp_app,
    export_cost,
    parse_export,
)
from engine.serve.otlp_limits import OtlpLimits, decoded_body
from engine.serve.protocol import ApiError
from engine.serve.rate_limit import Rate, RateLimiter
from engine.store import Database, open_database
from engine.store.models import SlowQueryRow, TracedRequestRow
from engine.store.retention import RetentionLimits

TOKEN = "s3cret-otlp"
NOW = 1_780_000_000.0  # the receiver's wall clock in these tests (2026)
SMALL = OtlpLimits(max_body_bytes=64 << 10, max_export_bytes=128 << 10, max_spans=50,
                   max_entries=60, body_timeout_s=0.2, rate=Rate(per_second=10.0, burst=100.0),
                   global_rate=Rate(per_second=30.0, burst=300.0))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def value(raw: object) -> AnyValue:
    if isinstance(raw, str):
        return AnyValue(string_value=raw)
    if isinstance(raw, bool):
        return AnyValue(bool_value=raw)
    if isinstance(raw, int):
        return AnyValue(int_value=raw)
    return AnyValue(double_value=raw)


def request_span(request_id: str = "cmpl-1", *, start: float = NOW - 10, prompt: object = 100,
                 completion: object = 20, prefill: object = 0.05, **extra: object) -> Span:
    attrs = {"gen_ai.request.id": request_id, "gen_ai.usage.prompt_tokens": prompt,
             "gen_ai.usage.completion_tokens": completion,
             "gen_ai.latency.time_in_model_prefill": prefill,
             "gen_ai.latency.time_to_first_token": 0.06, "gen_ai.latency.e2e": 1.0, **extra}
    return Span(name="llm_request", start_time_unix_nano=int(start * 1e9),
                attributes=[KeyValue(key=k, value=value(v)) for k, v in attrs.items()
                            if v is not None])


def export(*spans: Span, service: str = "vllm-a") -> bytes:
    message = ExportTraceServiceRequest()
    resource = message.resource_spans.add()
    resource.resource.attributes.append(KeyValue(key="service.name", value=value(service)))
    resource.scope_spans.add().spans.extend(spans)
    return message.SerializeToString()


def headers(token: str | None = TOKEN, **more: str) -> dict[str, str]:
    given = {"Content-Type": PROTOBUF, **more}
    if token is not None:
        given["Authorization"] = f"Bearer {token}"
    return given


@pytest.fixture
def database(tmp_path: Path) -> Iterator[Database]:
    opened = open_database(tmp_path / "traces.db")
    yield opened
    opened.close()


def receiver(collector: TraceCollector, clock: Clock | None = None) -> TestClient:
    app = create_otlp_app(collector, token=TOKEN, allowed_hosts=["127.0.0.1"],
                          clock=clock or Clock())
    return TestClient(app, base_url="http://127.0.0.1")


def collector_with(database: Database | None = None, **kwargs: object) -> TraceCollector:
    return TraceCollector(PrefillEstimate(lambda _shape: 0.01, "roofline", "a fixed 10 ms"),
                          database, limits=SMALL, wall_clock=lambda: NOW, **kwargs)


def test_the_token_and_the_host_are_checked_before_the_body_is_read() -> None:
    collector = collector_with()
    body = export(request_span())
    with receiver(collector) as client:
        assert client.post("/v1/traces", content=body, headers=headers(None)).status_code == 401
        wrong = client.post("/v1/traces", content=body, headers=headers("guess"))
        assert wrong.status_code == 401 and "Authorization=Bearer" in wrong.text
        # OTLP/HTTP's error body: a google.rpc.Status, code 16 (UNAUTHENTICATED) and message
        assert wrong.headers["content-type"] == PROTOBUF
        assert wrong.content.startswith(b"\x08\x10\x12")
        rebound = client.post("/v1/traces", content=body,
                              headers={**headers(), "Host": "evil.example:4318"})
        assert rebound.status_code == 400 and "not allowed" in rebound.text
        assert collector.received == 0
        good = client.post("/v1/traces", content=body, headers=headers())
        assert good.status_code == 200 and good.headers["content-type"] == PROTOBUF
    assert collector.received == 1


def test_bombs_and_broken_gzip_are_refused_at_their_caps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    inflated: list[int] = []
    decompressobj = zlib.decompressobj

    class Counting:
        """The receiver's inflater, counting the bytes it gives out."""

        def __init__(self, *args: int) -> None:
            self.inner = decompressobj(*args)

        def decompress(self, data: bytes, max_length: int = 0) -> bytes:
            out = self.inner.decompress(data, max_length)
            inflated.append(len(out))
            return out

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

    monkeypatch.setattr(zlib, "decompressobj", Counting)
    collector = collector_with()
    body = export(request_span())
    bomb = gzip.compress(b"\0" * (20 << 20), compresslevel=9)  # 20 MB in ~20 KB
    assert len(bomb) < SMALL.max_body_bytes
    with receiver(collector) as client:
        post = lambda content, **more: client.post(  # noqa: E731
            "/v1/traces", content=content, headers=headers(**more))
        assert post(bomb, **{"Content-Encoding": "gzip"}).status_code == 413
        assert sum(inflated) <= SMALL.max_export_bytes + 1  # stopped at the cap, not 20 MB
        assert post(b"\0" * (SMALL.max_body_bytes + 1)).status_code == 413
        broken = post(gzip.compress(body)[:-12], **{"Content-Encoding": "gzip"})
        assert broken.status_code == 400 and "ends early" in broken.text
        assert post(b"not gzip at all", **{"Content-Encoding": "gzip"}).status_code == 400
        assert post(body, **{"Content-Encoding": "br"}).status_code == 415
        assert post(b"\xff\xff\xff").status_code == 400
        assert collector.received == 0
        upper = post(gzip.compress(body), **{"Content-Encoding": "GZIP"})
        assert upper.status_code == 200
    assert collector.received == 1


def test_a_body_that_never_finishes_is_cut_off() -> None:
    app = create_otlp_app(collector_with(), token=None, allowed_hosts=["127.0.0.1"])
    sent: list[dict[str, object]] = []

    async def exchange() -> None:
        stalled = asyncio.Event()
        chunks = [{"type": "http.request", "body": b"\x0a", "more_body": True}]

        async def receive() -> dict[str, object]:
            if chunks:
                return chunks.pop()
            await stalled.wait()  # the client never sends the rest
            return {"type": "http.disconnect"}

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/traces", "raw_path": b"",
                 "query_string": b"", "root_path": "", "scheme": "http", "http_version": "1.1",
                 "server": ("127.0.0.1", 4318), "client": ("127.0.0.1", 5000),
                 "headers": [(b"host", b"127.0.0.1:4318"), (b"content-type", PROTOBUF.encode()),
                             (b"content-length", b"1000")]}
        await app(scope, receive, send)

    asyncio.run(asyncio.wait_for(exchange(), 10))
    assert sent[0]["status"] == 408


def test_a_flood_of_spans_is_capped_per_export_and_rated_per_client() -> None:
    clock = Clock()
    collector = collector_with()
    with receiver(collector, clock) as client:
        post = lambda spans: client.post(  # noqa: E731
            "/v1/traces", content=export(*spans), headers=headers())
        over = post([request_span(f"r{i}") for i in range(SMALL.max_spans + 1)])
        assert over.status_code == 413 and "OTEL_BSP_MAX_EXPORT_BATCH_SIZE" in over.text
        assert collector.received == 0
        # an export costs its spans, its resource and its scope: 48 + 2
        full = [request_span(f"r{i}") for i in range(SMALL.max_spans - 2)]
        assert post(full).status_code == 200 and post(full).status_code == 200  # the burst
        refused = post([request_span("one-more")])
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        clock.now += 1.0  # 10 entries a second come back, no more
        assert post(full[:8]).status_code == 200
        assert post(full[:1]).status_code == 429
        clock.now += 1000.0  # a gap far longer than the bucket: it refills to the burst only
        assert post(full).status_code == 200 and post(full).status_code == 200
        assert post(full[:1]).status_code == 429
    assert collector.received == 4 * (SMALL.max_spans - 2) + 8


def test_the_rate_limiter_refills_exactly_across_gaps_and_forgets_old_sources() -> None:
    clock = Clock()
    limiter = RateLimiter(Rate(per_second=2.0, burst=4.0), clock, max_sources=2)
    assert limiter.spend("a", 4) == 0.0 and limiter.spend("a", 1) == pytest.approx(0.5)
    clock.now = 10_000.0
    assert limiter.available("a") == 4.0  # capped at the burst after any gap
    clock.now = 9_000.0  # a clock stepping back refills nothing and drains nothing
    assert limiter.available("a") == 4.0
    assert math.isinf(limiter.spend("a", 5))
    assert limiter.spend("a", 4) == 0.0 and limiter.available("a") == 0.0
    limiter.spend("b", 1)
    limiter.spend("c", 1)  # two sources remembered at most: "a" is forgotten, bucket and all
    assert limiter.available("a") == 4.0


POISON = {
    "nan prompt tokens": request_span("p1", prompt=float("nan")),
    "infinite prefill": request_span("p2", prefill=float("inf")),
    "1e300 prompt tokens": request_span("p3", prompt=1e300),
    "-2^63 tokens": request_span("p4", completion=-(2 ** 63)),
    "year 2540": request_span("p5", start=1.8e10),
    "time zero": request_span("p6", start=0.0),
    "terminal escape id": request_span("\x1b]0;owned\x07"),
    "clear-screen id": request_span("x\x1b[2J"),
    "huge id": request_span("x" * 10_000),
    "no id": request_span(None),  # type: ignore[arg-type]
    "string tokens": request_span("p7", prompt="12"),
    "bool tokens": request_span("p8", prompt=True),
    "fractional tokens": request_span("p9", prompt=1.5),
    "negative latency": request_span("p10", prefill=-0.5),
    "prefill longer than the request": request_span("p11", prefill=5.0),
}


def test_each_poison_span_is_rejected_alone_with_a_partial_success(database: Database) -> None:
    collector = collector_with(database)
    good = [request_span(f"good-{i}") for i in range(9)]
    mixed = good[:5] + list(POISON.values()) + good[5:]
    with receiver(collector) as client:
        answer = client.post("/v1/traces", content=export(*mixed), headers=headers())
    assert answer.status_code == 200
    response = ExportTraceServiceResponse.FromString(answer.content)
    assert response.partial_success.rejected_spans == len(POISON)
    message = response.partial_success.error_message
    assert f"{len(POISON)} of {len(mixed)} request spans rejected" in message
    assert "\x1b" not in message and len(message) < 2000
    with database.session() as session:
        stored = session.scalars(select(TracedRequestRow.request_id)).all()
    assert sorted(stored) == sorted(f"good-{i}" for i in range(9))
    assert collector.rejected == len(POISON)
    assert all(len(t.request_id) <= SMALL.max_text for t in collector.recent)


def test_a_bad_service_name_rejects_its_spans_and_no_others() -> None:
    collector = collector_with()
    message = ExportTraceServiceRequest.FromString(export(request_span("a"), service="x[/]\x07"))
    message.MergeFromString(export(request_span("b"), service="vllm-b"))
    response = collector.take(message)
    assert [t.request_id for t in response.requests] == ["b"]
    assert response.rejected == 1 and "service.name" in response.reasons[0]


def test_traced_rows_have_their_own_retention_that_spares_the_engines_own(
        database: Database) -> None:
    with database.session() as session, session.begin():
        session.add(SlowQueryRow(created_at=NOW, request_id="engine-own-1", tenant="default",
                                 tag=None, budget_score=9.0, prompt_tokens=10, prefill_s=1.0,
                                 budgeted_s=0.1, chunks=[], config={}, source=None))
    collector = collector_with(database, retention=RetentionLimits(
        slow_queries=1, traced_requests=30, traced_slow_queries=5))
    for batch in range(4):  # every span is slow: 5 s of prefill against a 10 ms estimate
        collector.ingest(export(*[request_span(f"t{batch}-{i}", prefill=0.9)
                                  for i in range(20)]))
    with database.session() as session:
        traced = session.scalar(select(func.count()).select_from(TracedRequestRow))
        traced_slow = session.scalar(select(func.count()).select_from(SlowQueryRow)
                                     .where(SlowQueryRow.source.is_not(None)))
        own = session.scalars(select(SlowQueryRow.request_id)
                              .where(SlowQueryRow.source.is_(None))).all()
    assert traced == 30 and traced_slow == 5
    assert own == ["engine-own-1"]


def test_limits_that_cannot_hold_an_export_are_refused() -> None:
    from engine.config import ConfigError

    with pytest.raises(ConfigError, match="burst"):
        OtlpLimits(max_spans=100, rate=Rate(per_second=1.0, burst=10.0))
    with pytest.raises(ConfigError, match="max_export_bytes"):
        OtlpLimits(max_export_bytes=0)
    with pytest.raises(ConfigError, match="per_second"):
        Rate(per_second=float("nan"), burst=1.0)


def test_a_receiver_without_a_token_must_be_asked_for(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    from console.cli.console import main as console_main
    from console.cli.main import main
    from console.cli.otlp_flags import OTLP_TOKEN_ENV

    monkeypatch.delenv(OTLP_TOKEN_ENV, raising=False)
    assert main(["serve", "--otlp-listen", "127.0.0.1:0", "--db", str(tmp_path / "s.db")]) == 2
    assert "--otlp-insecure" in capsys.readouterr().err
    assert console_main(["--attach", "http://127.0.0.1:9", "--otlp-listen", "127.0.0.1:0"]) == 2
    assert "needs a token" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert console_main(["--attach", "http://127.0.0.1:9", "--otlp-listen", "127.0.0.1:0",
                         "--otlp-token-file", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err


def asgi_post(app: object, body: bytes, client: str) -> int:
    """One POST /v1/traces from `client`'s address, straight through the ASGI app."""
    sent: list[dict[str, object]] = []

    async def exchange() -> None:
        chunks = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, object]:
            return chunks.pop(0) if chunks else {"type": "http.disconnect"}

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/traces", "raw_path":
                 b"/v1/traces", "query_string": b"", "http_version": "1.1", "scheme": "http",
                 "server": ("127.0.0.1", 4318), "client": (client, 5000),
                 "headers": [(b"host", b"127.0.0.1:4318"), (b"content-type", PROTOBUF.encode()),
                             (b"authorization", f"Bearer {TOKEN}".encode()),
                             (b"content-length", str(len(body)).encode())]}
        await app(scope, receive, send)  # type: ignore[operator]

    asyncio.run(asyncio.wait_for(exchange(), 10))
    return int(sent[0]["status"])  # type: ignore[call-overload]


def test_many_addresses_meet_a_global_rate_beside_their_own() -> None:
    clock = Clock()
    collector = collector_with()
    app = create_otlp_app(collector, token=TOKEN, allowed_hosts=["127.0.0.1"], clock=clock)
    body = export(*[request_span(f"r{i}") for i in range(SMALL.max_spans - 2)])  # costs 50
    answers = [asgi_post(app, body, f"10.0.0.{i}") for i in range(10)]
    assert answers == [200] * 6 + [429] * 4  # 300 for everyone together, 100 for each
    clock.now += 10.0  # 300 more come back to everyone: a new address is served again
    assert asgi_post(app, body, "10.0.1.1") == 200


def test_empty_resources_and_scopes_are_counted_before_parsing_and_against_the_rate() -> None:
    message = ExportTraceServiceRequest()
    for _ in range(SMALL.max_entries + 1):
        message.resource_spans.add()
    with pytest.raises(ApiError, match="resources, scopes and spans") as caught:
        parse_export(message.SerializeToString(), SMALL)
    assert caught.value.status == 413
    scopes = ExportTraceServiceRequest()
    resource = scopes.resource_spans.add()
    for _ in range(30):
        resource.scope_spans.add()
    resource.scope_spans[0].spans.append(request_span())
    parsed = parse_export(scopes.SerializeToString(), SMALL)
    assert export_cost(parsed) == 1 + 30 + 1
    clock = Clock()
    collector = collector_with()
    with receiver(collector, clock) as client:
        for expected in (200, 200, 200, 429):  # 32 each from a burst of 100
            answer = client.post("/v1/traces", content=scopes.SerializeToString(),
                                 headers=headers())
            assert answer.status_code == expected


def test_gzip_members_are_capped() -> None:
    one = gzip.compress(export(request_span()))
    assert decoded_body(one, "gzip", SMALL) == export(request_span())
    empty = gzip.compress(b"")
    with pytest.raises(ApiError, match="members") as caught:
        decoded_body(empty * (SMALL.max_gzip_members + 1), "gzip", SMALL)
    assert caught.value.status == 400
    assert decoded_body(empty * SMALL.max_gzip_members, "gzip", SMALL) == b""


def test_a_locked_store_is_retried_then_answered_503_never_500(database: Database) -> None:
    slept: list[float] = []
    collector = collector_with(database, sleep=slept.append)
    with database.engine.connect() as pooled:  # SQLite's own wait, shortened for the test
        pooled.exec_driver_sql("PRAGMA busy_timeout=0")
    holder = sqlite3.connect(database.path, timeout=0)
    holder.execute("BEGIN EXCLUSIVE")  # another writer holds the file
    try:
        with receiver(collector) as client:
            answer = client.post("/v1/traces", content=export(request_span("r-locked")),
                                 headers=headers())
        assert answer.status_code == 503 and answer.headers["Retry-After"] == "1"
        assert slept == list(STORE_RETRY_S)
    finally:
        holder.rollback()
        holder.close()
    with receiver(collector) as client:  # free again: stored
        assert client.post("/v1/traces", content=export(request_span("r-free")),
                           headers=headers()).status_code == 200
