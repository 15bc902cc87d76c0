"""One traced request: what a vLLM `llm_request` span says, each figure checked at the edge."""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from engine.serve.otlp_limits import OtlpLimits
from engine.snapshot import RequestView

REQUEST_SPAN = "llm_request"
UNKNOWN_SERVICE = "unknown_service"

# vLLM's span attributes (vllm/tracing/utils.py SpanAttributes)
ATTR_SERVICE = "service.name"
ATTR_REQUEST_ID = "gen_ai.request.id"
ATTR_PROMPT = "gen_ai.usage.prompt_tokens"
ATTR_COMPLETION = "gen_ai.usage.completion_tokens"
ATTR_QUEUE = "gen_ai.latency.time_in_queue"
ATTR_TTFT = "gen_ai.latency.time_to_first_token"
ATTR_PREFILL = "gen_ai.latency.time_in_model_prefill"
ATTR_DECODE = "gen_ai.latency.time_in_model_decode"
ATTR_E2E = "gen_ai.latency.e2e"


class SpanRejected(ValueError):
    """Why one span was not taken; the message never holds the span's own text unescaped."""


@dataclass(frozen=True)
class TracedRequest:
    source: str
    request_id: str
    started_at: float
    prompt_tokens: int
    completion_tokens: int
    queue_s: float | None
    ttft_s: float | None
    prefill_s: float | None
    decode_s: float | None
    e2e_s: float | None
    predicted_prefill_s: float | None = None
    budget_score: float | None = None
    estimate: str | None = None

    def view(self) -> RequestView:
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


def service_name(resource_attributes: Iterable[KeyValue], limits: OtlpLimits) -> str:
    """The resource's service.name, checked as text (SpanRejected for all its spans if bad)."""
    value = attributes(resource_attributes).get(ATTR_SERVICE, UNKNOWN_SERVICE)
    return _text(value, ATTR_SERVICE, limits)


def traced_request(source: str, span: Span, limits: OtlpLimits, now: float) -> TracedRequest:
    """The request one `llm_request` span describes; SpanRejected names the first bad field."""
    attrs = attributes(span.attributes)
    started_at = span.start_time_unix_nano / 1e9
    if not limits.earliest <= started_at <= now + limits.future_s:
        raise SpanRejected(f"start time {started_at:.0f} s since the epoch is not a time this "
                           "request could have started")

    def seconds(key: str) -> float | None:
        value = attrs.get(key)
        if value is None:
            return None
        number = _number(value, key)
        if not 0.0 <= number <= limits.max_seconds:
            raise SpanRejected(f"{key} = {number!r} is outside [0, {limits.max_seconds:g}] s")
        return number

    def count(key: str) -> int:
        value = attrs.get(key, 0)
        number = _number(value, key)
        if not number.is_integer() or not 0 <= number <= limits.max_tokens:
            raise SpanRejected(f"{key} = {value!r} is not a whole number in "
                               f"[0, {limits.max_tokens}]")
        return int(value)

    traced = TracedRequest(
        source=source, request_id=_text(attrs.get(ATTR_REQUEST_ID), ATTR_REQUEST_ID, limits),
        started_at=started_at, prompt_tokens=count(ATTR_PROMPT),
        completion_tokens=count(ATTR_COMPLETION), queue_s=seconds(ATTR_QUEUE),
        ttft_s=seconds(ATTR_TTFT), prefill_s=seconds(ATTR_PREFILL),
        decode_s=seconds(ATTR_DECODE), e2e_s=seconds(ATTR_E2E))
    if traced.e2e_s is not None:
        for key, part in ((ATTR_TTFT, traced.ttft_s), (ATTR_PREFILL, traced.prefill_s)):
            if part is not None and part > traced.e2e_s * (1 + 1e-6) + 1e-6:
                raise SpanRejected(f"{key} = {part!r} s is longer than the whole request "
                                   f"({ATTR_E2E} = {traced.e2e_s!r} s)")
    return traced


def attributes(pairs: Iterable[KeyValue]) -> dict[str, object]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def _number(value: object, key: str) -> float:
    # bool is an int to Python, not a figure; a string is never read as one
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpanRejected(f"{key} is a {type(value).__name__}, not a number")
    number = float(value)
    if not math.isfinite(number):
        raise SpanRejected(f"{key} = {value!r} is not a finite number")
    return number


def _text(value: object, key: str, limits: OtlpLimits) -> str:
    if not isinstance(value, str) or not value:
        raise SpanRejected(f"{key} is missing or not a string")
    if len(value) > limits.max_text:
        raise SpanRejected(f"{key} is {len(value)} characters long; the limit is "
                           f"{limits.max_text}")
    if any(unicodedata.category(char) == "Cc" for char in value):
        raise SpanRejected(f"{key} {value[:40]!a} holds control characters")
    return value
