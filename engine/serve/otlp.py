"""OTLP/HTTP trace collection: other engines' per-request spans become traced requests.

vLLM (started with --otlp-traces-endpoint and OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=
http/protobuf) sends one `llm_request` span per finished request, holding its queue, TTFT,
prefill and decode times, token counts and request id. Bodies are decoded with the
OpenTelemetry protobufs. Each request gets a budget_score: its measured prefill time over
the prefill time predicted for that prompt on that GPU, by the calibration stored for that
model and GPU when there is one, else by the roofline; each score names its estimate.
Requests and slow queries land in the store with their source recorded.
"""

from __future__ import annotations

import dataclasses
import gzip
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from sqlalchemy import insert, select
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine.budget.roofline import StepShape
from engine.snapshot import RequestView
from engine.store import Database, SlowQueryRecord, TracedDriftPoint, traced_drift
from engine.store.models import SlowQueryRow, TracedRequestRow

REQUEST_SPAN = "llm_request"  # vLLM's span per request; start-up spans carry other names
SLOW_THRESHOLD = 1.5  # the engine's default slow_query_threshold
KEEP = 200  # traced requests kept in memory for the Requests table
PROTOBUF = "application/x-protobuf"

# vLLM's span attributes (vllm/tracing/utils.py SpanAttributes)
ATTR_REQUEST_ID = "gen_ai.request.id"
ATTR_PROMPT = "gen_ai.usage.prompt_tokens"
ATTR_COMPLETION = "gen_ai.usage.completion_tokens"
ATTR_QUEUE = "gen_ai.latency.time_in_queue"
ATTR_TTFT = "gen_ai.latency.time_to_first_token"
ATTR_PREFILL = "gen_ai.latency.time_in_model_prefill"
ATTR_DECODE = "gen_ai.latency.time_in_model_decode"
ATTR_E2E = "gen_ai.latency.e2e"


@dataclass(frozen=True)
class PrefillEstimate:
    """What a traced prefill should take on the traced GPU, and which estimate says so."""

    predict: Callable[[StepShape], float]  # seconds for a step of that shape
    name: str  # "roofline" or "calibration ID": stored with every score
    detail: str  # in words: whose roofline or calibration, on which GPU

    @property
    def label(self) -> str:
        return f"budget_score = measured prefill / {self.name} estimate ({self.detail})"


@dataclass(frozen=True)
class TracedRequest:
    source: str  # the span's service.name (OTEL_SERVICE_NAME on the server)
    request_id: str
    started_at: float  # epoch seconds: when the server received the request
    prompt_tokens: int
    completion_tokens: int
    queue_s: float | None
    ttft_s: float | None
    prefill_s: float | None
    decode_s: float | None
    e2e_s: float | None
    predicted_prefill_s: float | None = None  # None without a model shape
    budget_score: float | None = None
    estimate: str | None = None  # PrefillEstimate.name of the prediction

    def view(self) -> RequestView:
        """A finished row of the Requests table (a span arrives when its request is done)."""
        def ms(seconds: float | None) -> float | None:
            return None if seconds is None else seconds * 1000.0

        decode_tokens = max(self.completion_tokens - 1, 0)
        tpot = (self.decode_s / decode_tokens
                if self.decode_s is not None and decode_tokens else None)
        return RequestView(
            id=self.request_id, tenant=self.source, state="FINISHED",
            reason="traced" if self.estimate is None else f"traced; vs {self.estimate} estimate",
            prompt_tokens=self.prompt_tokens, prefilled_tokens=self.prompt_tokens,
            chunks_done=1, chunks_total=1, generated_tokens=self.completion_tokens,
            ttft_ms=ms(self.ttft_s), tpot_ms=ms(tpot), budget_score=self.budget_score,
            arrival_s=self.started_at)


def decode_export(body: bytes) -> list[TracedRequest]:
    """Every `llm_request` span of one OTLP export body (protobuf); other spans are skipped."""
    message = ExportTraceServiceRequest()
    message.ParseFromString(body)
    found = []
    for resource_spans in message.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        source = str(resource.get("service.name", "unknown_service"))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                if span.name == REQUEST_SPAN:
                    found.append(_traced(source, span.start_time_unix_nano,
                                         _attributes(span.attributes)))
    return found


def _traced(source: str, start_ns: int, attrs: dict[str, object]) -> TracedRequest:
    def seconds(key: str) -> float | None:
        value = attrs.get(key)
        return float(value) if isinstance(value, int | float) else None

    def count(key: str) -> int:
        value = attrs.get(key)
        return int(value) if isinstance(value, int | float) else 0

    return TracedRequest(
        source=source, request_id=str(attrs.get(ATTR_REQUEST_ID, "")),
        started_at=start_ns / 1e9, prompt_tokens=count(ATTR_PROMPT),
        completion_tokens=count(ATTR_COMPLETION), queue_s=seconds(ATTR_QUEUE),
        ttft_s=seconds(ATTR_TTFT), prefill_s=seconds(ATTR_PREFILL),
        decode_s=seconds(ATTR_DECODE), e2e_s=seconds(ATTR_E2E))


def _attributes(pairs: list[KeyValue]) -> dict[str, object]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


class TraceCollector:
    """Scores and keeps traced requests; safe to feed from the HTTP thread and read elsewhere.

    `estimate` predicts each prefill; without it budget scores stay empty and say why.
    """

    def __init__(self, estimate: PrefillEstimate | None = None,
                 database: Database | None = None,
                 slow_threshold: float = SLOW_THRESHOLD, keep: int = KEEP) -> None:
        self.estimate = estimate
        self.database = database
        self.slow_threshold = slow_threshold
        self.recent: deque[TracedRequest] = deque(maxlen=keep)
        self.slow_counts: dict[str, int] = {}  # by source
        self.received = 0
        self.lock = threading.Lock()
        self.arrived = threading.Condition(self.lock)

    @property
    def score_label(self) -> str:
        if self.estimate is None:
            return "no budget_score: give the model's shape (--roofline-model) and --gpu"
        return self.estimate.label

    def ingest(self, body: bytes) -> list[TracedRequest]:
        """Decode, score and keep one export; returns the traced requests it held."""
        scored = [self.score(traced) for traced in decode_export(body)]
        now = time.time()
        slow = [t for t in scored if t.budget_score is not None
                and t.budget_score >= self.slow_threshold]
        if self.database is not None and scored:
            self._store(scored, slow, now)
        with self.arrived:
            self.recent.extend(scored)
            for t in slow:
                self.slow_counts[t.source] = self.slow_counts.get(t.source, 0) + 1
            self.received += len(scored)
            self.arrived.notify_all()
        return scored

    def score(self, traced: TracedRequest) -> TracedRequest:
        if self.estimate is None or traced.prefill_s is None or traced.prompt_tokens <= 0:
            return traced
        predicted = self.estimate.predict(StepShape(prefill=((traced.prompt_tokens, 0),)))
        return dataclasses.replace(traced, predicted_prefill_s=predicted,
                                   budget_score=traced.prefill_s / predicted,
                                   estimate=self.estimate.name)

    def wait_for(self, count: int, timeout: float | None = None) -> bool:
        """Block until `count` traced requests have arrived in all (for tests and tools)."""
        with self.arrived:
            return self.arrived.wait_for(lambda: self.received >= count, timeout)

    def request_views(self, source: str | None = None) -> tuple[RequestView, ...]:
        """Recent traced requests (of one source, or all), newest first."""
        with self.lock:
            rows = [t for t in self.recent if source is None or t.source == source]
        return tuple(t.view() for t in reversed(rows))

    def slow_total(self, source: str | None = None) -> int:
        """Slow queries traced since start (of one source, or all)."""
        with self.lock:
            return self.slow_counts.get(source, 0) if source else sum(self.slow_counts.values())

    def slow_queries(self, source: str | None = None, limit: int = 500) -> list[SlowQueryRecord]:
        """Traced slow queries from the store, newest first (none without a store)."""
        if self.database is None:
            return []
        query = select(SlowQueryRow).where(SlowQueryRow.source.is_not(None))
        if source is not None:
            query = query.where(SlowQueryRow.source == source)
        query = query.order_by(SlowQueryRow.created_at.desc()).limit(limit)
        with self.database.session() as session:
            return [SlowQueryRecord.from_row(row) for row in session.scalars(query)]

    def drift(self, source: str | None = None) -> list[TracedDriftPoint]:
        """Measured/predicted prefill ratio over time from the stored traced requests (of one
        source, or all), oldest first; none without a store."""
        if self.database is None:
            return []
        with self.database.session() as session:
            return traced_drift(session, source=source)

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


def create_otlp_app(collector: TraceCollector) -> Starlette:
    """POST /v1/traces, as an OTLP/HTTP receiver answers it (protobuf only)."""

    async def traces(request: Request) -> Response:
        if request.headers.get("content-type", "").split(";")[0].strip() != PROTOBUF:
            return Response("send OTLP as protobuf: set OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="
                            "http/protobuf on the server", status_code=415)
        body = await request.body()
        if request.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        try:
            collector.ingest(body)
        except DecodeError as exc:
            return Response(f"not an OTLP trace export: {exc}", status_code=400)
        return Response(ExportTraceServiceResponse().SerializeToString(), media_type=PROTOBUF)

    return Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])])
