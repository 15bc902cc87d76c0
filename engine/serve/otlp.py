"""OTLP/HTTP trace collection: other engines' per-request spans become scored traced requests."""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from sqlalchemy import insert, select
from sqlalchemy.exc import SQLAlchemyError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine.budget.roofline import StepShape
from engine.serve.auth import bearer_matches
from engine.serve.hosts import HostAllowList
from engine.serve.otlp_limits import OtlpLimits, decoded_body, entry_count
from engine.serve.otlp_span import (
    REQUEST_SPAN,
    SpanRejected,
    TracedRequest,
    service_name,
    traced_request,
)
from engine.serve.protocol import ApiError, read_body
from engine.serve.rate_limit import RateLimiter
from engine.snapshot import RequestView
from engine.store import Database, SlowQueryRecord, TracedDriftPoint, traced_drift
from engine.store.models import SlowQueryRow, TracedRequestRow
from engine.store.retention import RetentionLimits, apply_traced_retention

log = logging.getLogger(__name__)
SLOW_THRESHOLD = 1.5
STORE_RETRY_S = (0.05, 0.2, 0.5, 1.0)  # SQLite's own busy timeout comes first
STORE_RETRY_AFTER_S = 1
GLOBAL = "every client"
KEEP = 200
PROTOBUF = "application/x-protobuf"
REASONS_SHOWN = 3


@dataclass(frozen=True)
class PrefillEstimate:
    """What a traced prefill should take on the traced GPU, and which estimate says so."""

    predict: Callable[[StepShape], float]
    name: str
    detail: str

    @property
    def label(self) -> str:
        return f"budget_score = measured prefill / {self.name} estimate ({self.detail})"


@dataclass(frozen=True)
class Export:
    """One export: the requests taken, and the request spans rejected (each alone) with reasons."""

    requests: list[TracedRequest]
    rejected: int = 0
    reasons: tuple[str, ...] = ()

    def response(self) -> ExportTraceServiceResponse:
        """OTLP's answer: a partial success counting the rejected spans, when there are any."""
        answer = ExportTraceServiceResponse()
        if self.rejected:
            answer.partial_success.rejected_spans = self.rejected
            answer.partial_success.error_message = (
                f"{self.rejected} of {self.rejected + len(self.requests)} request spans "
                f"rejected: {'; '.join(self.reasons)}")
        return answer


def parse_export(body: bytes, limits: OtlpLimits) -> ExportTraceServiceRequest:
    """One OTLP export body (protobuf bytes): 400 if it is not one, 413 past `max_entries`
    (counted before parsing) or `max_spans`."""
    entry_count(body, limits)
    message = ExportTraceServiceRequest()
    try:
        message.ParseFromString(body)
    except DecodeError as exc:
        raise ApiError(400, f"not an OTLP trace export ({exc}); send "
                            "ExportTraceServiceRequest as protobuf") from None
    total = span_count(message)
    if total > limits.max_spans:
        raise ApiError(413, f"the export holds {total} spans; the limit is {limits.max_spans} "
                            "(set OTEL_BSP_MAX_EXPORT_BATCH_SIZE on the server)")
    return message


def span_count(message: ExportTraceServiceRequest) -> int:
    return sum(len(scope.spans) for resource in message.resource_spans
               for scope in resource.scope_spans)


def export_cost(message: ExportTraceServiceRequest) -> int:
    """What an export spends of the rate: every resource, scope and span (at least 1)."""
    scopes = sum(len(resource.scope_spans) for resource in message.resource_spans)
    return max(1, len(message.resource_spans) + scopes + span_count(message))


def decode_export(message: ExportTraceServiceRequest, limits: OtlpLimits,
                  now: float) -> Export:
    """Every `llm_request` span of one export, each checked alone; other spans are skipped."""
    found: list[TracedRequest] = []
    reasons: list[str] = []
    rejected = 0
    for resource_spans in message.resource_spans:
        spans = [span for scope in resource_spans.scope_spans for span in scope.spans
                 if span.name == REQUEST_SPAN]
        try:
            source = service_name(resource_spans.resource.attributes, limits)
        except SpanRejected as exc:
            rejected += len(spans)
            reasons.append(str(exc))
            continue
        for span in spans:
            try:
                found.append(traced_request(source, span, limits, now))
            except SpanRejected as exc:
                rejected += 1
                reasons.append(str(exc))
    return Export(found, rejected, tuple(reasons[:REASONS_SHOWN]))


class TraceCollector:
    """Scores and keeps traced requests; fed from the HTTP thread, read elsewhere."""

    def __init__(self, estimate: PrefillEstimate | None = None,
                 database: Database | None = None,
                 slow_threshold: float = SLOW_THRESHOLD, keep: int = KEEP, *,
                 limits: OtlpLimits | None = None,
                 retention: RetentionLimits | None = None,
                 wall_clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.estimate = estimate
        self.database = database
        self.slow_threshold = slow_threshold
        self.limits = limits or OtlpLimits()
        self.retention = retention or RetentionLimits()
        self.wall_clock = wall_clock
        self.sleep = sleep
        # small and bounded: every string in an entry is capped by the limits
        self.recent: deque[TracedRequest] = deque(maxlen=keep)
        self.slow_counts: dict[str, int] = {}
        self.received = 0
        self.rejected = 0
        self.lock = threading.Lock()
        self.arrived = threading.Condition(self.lock)

    @property
    def score_label(self) -> str:
        if self.estimate is None:
            return "no budget_score: give the model's shape (--roofline-model) and --gpu"
        return self.estimate.label

    def ingest(self, body: bytes) -> Export:
        """Parse, check, score and keep one export (protobuf bytes); see `take`."""
        return self.take(parse_export(body, self.limits))

    def take(self, message: ExportTraceServiceRequest) -> Export:
        """Check, score and keep one parsed export; a bad span is rejected alone."""
        now = self.wall_clock()
        export = decode_export(message, self.limits, now)
        scored = [self.score(traced) for traced in export.requests]
        slow = [t for t in scored if t.budget_score is not None
                and t.budget_score >= self.slow_threshold]
        if self.database is not None and scored:
            self._stored(scored, slow, now)
        with self.arrived:
            self.recent.extend(scored)
            for t in slow:
                self.slow_counts[t.source] = self.slow_counts.get(t.source, 0) + 1
            self.received += len(scored)
            self.rejected += export.rejected
            self.arrived.notify_all()
        return dataclasses.replace(export, requests=scored)

    def score(self, traced: TracedRequest) -> TracedRequest:
        if self.estimate is None or traced.prefill_s is None or traced.prompt_tokens <= 0:
            return traced
        predicted = self.estimate.predict(StepShape(prefill=((traced.prompt_tokens, 0),)))
        if not (math.isfinite(predicted) and predicted > 0):
            return traced
        return dataclasses.replace(traced, predicted_prefill_s=predicted,
                                   budget_score=traced.prefill_s / predicted,
                                   estimate=self.estimate.name)

    def wait_for(self, count: int, timeout: float | None = None) -> bool:
        with self.arrived:
            return self.arrived.wait_for(lambda: self.received >= count, timeout)

    def request_views(self, source: str | None = None) -> tuple[RequestView, ...]:
        with self.lock:
            rows = [t for t in self.recent if source is None or t.source == source]
        return tuple(t.view() for t in reversed(rows))

    def slow_total(self, source: str | None = None) -> int:
        with self.lock:
            return self.slow_counts.get(source, 0) if source else sum(self.slow_counts.values())

    def slow_queries(self, source: str | None = None, limit: int = 500) -> list[SlowQueryRecord]:
        if self.database is None:
            return []
        query = select(SlowQueryRow).where(SlowQueryRow.source.is_not(None))
        if source is not None:
            query = query.where(SlowQueryRow.source == source)
        query = query.order_by(SlowQueryRow.created_at.desc()).limit(limit)
        with self.database.session() as session:
            return [SlowQueryRecord.from_row(row) for row in session.scalars(query)]

    def drift(self, source: str | None = None) -> list[TracedDriftPoint]:
        """Measured/predicted prefill ratio over time (one source, or all); none without a store."""
        if self.database is None:
            return []
        with self.database.session() as session:
            return traced_drift(session, source=source)

    def _stored(self, scored: list[TracedRequest], slow: list[TracedRequest],
                now: float) -> None:
        """Store, retrying while the store is busy ("database is locked"); 503 with
        Retry-After if it stays busy or fails, never a 500 (and no span data in the log)."""
        for attempt, delay in enumerate((*STORE_RETRY_S, None)):
            try:
                self._store(scored, slow, now)
                return
            except SQLAlchemyError as exc:
                reason = str(getattr(exc, "orig", None) or exc).splitlines()[0][:200]
                if delay is None or ("locked" not in reason and "busy" not in reason):
                    log.warning("the trace store refused an export after %d tries: %s",
                                attempt + 1, reason)
                    raise ApiError(503, f"the trace store is busy ({reason}); retry",
                                   kind="server_error",
                                   headers={"Retry-After": str(STORE_RETRY_AFTER_S)}) from None
                self.sleep(delay)

    def _store(self, scored: list[TracedRequest], slow: list[TracedRequest],
               now: float) -> None:
        config = {"prediction": self.score_label, "slow_query_threshold": self.slow_threshold}
        with self.database.engine.begin() as connection:  # type: ignore[union-attr]
            connection.execute(insert(TracedRequestRow), [
                {**t.__dict__, "received_at": now} for t in scored])
            if slow:
                connection.execute(insert(SlowQueryRow), [{
                    "created_at": now, "request_id": t.request_id, "tenant": "default",
                    "tag": None, "budget_score": t.budget_score,
                    "prompt_tokens": t.prompt_tokens, "prefill_s": t.prefill_s,
                    "budgeted_s": t.predicted_prefill_s,
                    "chunks": [], "config": config, "source": t.source} for t in slow])
            apply_traced_retention(connection, self.retention)


def create_otlp_app(collector: TraceCollector, *, token: str | None,
                    allowed_hosts: Iterable[str],
                    clock: Callable[[], float] = time.monotonic) -> Starlette:
    """POST /v1/traces (protobuf only), behind the Host allow-list and bearer `token`."""
    limits = collector.limits
    rates = RateLimiter(limits.rate, clock)
    overall = RateLimiter(limits.global_rate, clock, max_sources=1)

    async def traces(request: Request) -> Response:
        if token is not None and not bearer_matches(request.headers.get("authorization", ""),
                                                    token):
            raise ApiError(401, "missing or wrong bearer token; export with "
                                "OTEL_EXPORTER_OTLP_HEADERS='Authorization=Bearer TOKEN'",
                           kind="authentication_error", headers={"WWW-Authenticate": "Bearer"})
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != PROTOBUF:
            raise ApiError(415, "send OTLP as protobuf: set OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="
                                "http/protobuf on the server")
        client = request.client.host if request.client else "unknown"
        if rates.available(client) < 1:
            raise _slow_down(rates.spend(client, 1))
        if overall.available(GLOBAL) < 1:
            raise _slow_down(overall.spend(GLOBAL, 1))
        body = await read_body(request, limits.max_body_bytes, limits.body_timeout_s,
                               ApiError(413, f"the body is over {limits.max_body_bytes} bytes; "
                                             "send smaller batches "
                                             "(OTEL_BSP_MAX_EXPORT_BATCH_SIZE)"))
        message = parse_export(
            decoded_body(body, request.headers.get("content-encoding", ""), limits), limits)
        cost = export_cost(message)
        wait = max(rates.wait(client, cost), overall.wait(GLOBAL, cost))
        if wait:  # neither bucket is spent unless both have room
            raise _slow_down(wait)
        rates.spend(client, cost)
        overall.spend(GLOBAL, cost)
        export = await run_in_threadpool(collector.take, message)
        return Response(export.response().SerializeToString(), media_type=PROTOBUF)

    app = Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])],
                    exception_handlers={ApiError: _status_response})
    app.add_middleware(HostAllowList, allowed=allowed_hosts)
    return app


# google.rpc.Code of each refusal, for the Status body OTLP/HTTP answers errors with
GRPC_CODES = {400: 3, 401: 16, 408: 4, 413: 8, 415: 3, 429: 8}


async def _status_response(_request: Request, exc: Exception) -> Response:
    """An error as OTLP/HTTP answers one: a google.rpc.Status protobuf, written by hand."""
    assert isinstance(exc, ApiError)
    message = exc.message.encode()
    body = (b"\x08" + _varint(GRPC_CODES.get(exc.status, 2))
            + b"\x12" + _varint(len(message)) + message)
    return Response(body, status_code=exc.status, media_type=PROTOBUF, headers=exc.headers)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _slow_down(wait_s: float) -> ApiError:
    retry = max(1, math.ceil(min(wait_s, 3600.0)))
    return ApiError(429, f"this client sent more spans than the receiver takes; retry in "
                         f"{retry} s", kind="rate_limit_error", headers={"Retry-After": str(retry)})
