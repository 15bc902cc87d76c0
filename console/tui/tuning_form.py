"""The Tuning form's fields: the live-tunable settings and the traffic's arrival rate, each
with its bounds and why each bound is there, said beside the field as it is typed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from console.tui.collectors import RATE_FIELD


@dataclass(frozen=True)
class Field:
    name: str  # the EngineConfig field (RATE_FIELD: the traffic's arrival rate)
    label: str
    help: str
    kind: type  # int or float
    low: float
    high: float
    why: str  # what the upper bound protects, said when a value is above it
    why_low: str = ""  # what the lower bound protects, said when a value is below it

    def check(self, text: str) -> str | None:
        """Why `text` cannot be applied to this field, or None: the bound it broke, and why
        that bound is there."""
        try:
            value = float(text)
        except ValueError:
            return f"expected a {'whole ' if self.kind is int else ''}number, got {text!r}"
        if self.kind is int and value != int(value):
            return f"expected a whole number, got {text!r}"
        if value < self.low:
            return f"must be at least {self.low:g}" + (f": {self.why_low}" if self.why_low
                                                        else "")
        if value > self.high:
            return f"must be at most {self.high:g}: {self.why}"
        return None


FIELDS: tuple[Field, ...] = (
    Field(RATE_FIELD, "Arrival rate /s", "the console's traffic; 0 holds it", float, 0, 1000,
          "beyond 1000 requests/s the workload plays all at once"),
    Field("max_num_batched_tokens", "Token budget", "tokens one step may spend", int, 16, 65536,
          "one step beyond 65536 tokens outlasts any time-between-tokens SLO",
          "a step needs room for a chunk tile beside its decodes"),
    Field("chunk_tile", "Chunk tile", "chunks round down to a multiple", int, 1, 1024,
          "a tile beyond 1024 leaves most budgets one chunk or none"),
    Field("max_prefill_chunks", "Chunks at once", "partial prefills per step", int, 1, 64,
          "more than 64 partial prefills per step only thin each chunk"),
    Field("long_prefill_threshold", "Chunk cap", "per request per step; 0 = none", int, 0,
          65536, "0 turns the cap off; above 65536 it never binds"),
    Field("cache_high_watermark", "KV high mark", "stop admitting above", float, 0.05,
          0.99, "at 1 the cache fills before admission stops, and decodes preempt"),
    Field("cache_low_watermark", "KV low mark", "admit again below", float, 0.01, 0.98,
          "it must sit below the high watermark, above an empty cache"),
    Field("bandwidth_throttle_2", "BW throttle → 2", "5 s avg above: concurrency 2", float,
          0.05, 1.0, "a share of the device's peak bandwidth"),
    Field("bandwidth_throttle_1", "BW throttle → 1", "above: concurrency 1", float, 0.05, 1.0,
          "a share of the device's peak bandwidth"),
    Field("bandwidth_pause", "BW pause", "above: new prefills paused", float, 0.05, 1.0,
          "a share of the device's peak bandwidth"),
    Field("slow_query_threshold", "Slow query", "budget_score above is slow", float, 1.0, 10.0,
          "above 10 hides real slow queries", "a budget_score of 1 is on plan: below 1 flags "
          "healthy requests"),
    Field("slow_query_min_overrun_ms", "Slow query min", "ms over plan, at least", float, 0.0,
          10_000.0, "milliseconds a prefill must overrun its plan to be a slow query"),
)
BY_NAME = {field.name: field for field in FIELDS}


def shown(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)

