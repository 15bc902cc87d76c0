"""GET /metrics: the Prometheus text format, with vLLM's names under the `tokenflow:` prefix.

Where vLLM has a metric of the same meaning we use its name, type and histogram buckets
(engine.ops.metrics), so dashboards built for vLLM read tokenflow unchanged; the chunk queue,
cache pressure, bandwidth and budget score are ours. Every sample carries `model_name`.
"""

from __future__ import annotations

from engine.budget.plan import BUDGET_SCORE_DEFINITION
from engine.core.engine import Engine
from engine.ops.metrics import Histogram
from engine.serve.loop import LoopHealth
from engine.snapshot import Snapshot

PREFIX = "tokenflow:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def render_metrics(engine: Engine, snapshot: Snapshot, health: LoopHealth | None = None) -> str:
    m = engine.metrics
    watermark = engine.config.cache_high_watermark
    labels = f'model_name="{_escape(snapshot.model)}"'
    out: list[str] = []

    def gauge(name: str, help_text: str, value: float) -> None:
        out.extend(_header(name, help_text, "gauge"))
        out.append(f"{PREFIX}{name}{{{labels}}} {float(value)!r}")

    def counter(name: str, help_text: str, value: float) -> None:
        out.extend(_header(f"{name}_total", help_text, "counter"))  # as prometheus_client does
        out.append(f"{PREFIX}{name}_total{{{labels}}} {float(value)!r}")

    def histogram(name: str, help_text: str, h: Histogram) -> None:
        out.extend(_header(name, help_text, "histogram"))
        rows = h.cumulative()
        out.extend(f'{PREFIX}{name}_bucket{{{labels},le="{le}"}} {float(n)!r}' for le, n in rows)
        out.append(f"{PREFIX}{name}_count{{{labels}}} {float(rows[-1][1])!r}")
        out.append(f"{PREFIX}{name}_sum{{{labels}}} {float(h.total)!r}")

    gauge("num_requests_running", "Requests in model execution batches.", snapshot.num_running)
    gauge("num_requests_waiting", "Requests waiting to be scheduled.", snapshot.num_waiting)
    gauge("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", snapshot.kv_usage)
    counter("num_preemptions", "Cumulative preemptions (recompute).", m.preemptions_total)
    counter("prompt_tokens", "Prefill tokens of requests received.", m.prompt_tokens_total)
    counter("generation_tokens", "Generated tokens.", m.generation_tokens_total)
    counter("prefix_cache_queries", "Prefix-cache queries, in tokens looked up at admission.",
            m.prefix_cache_queries_total)
    counter("prefix_cache_hits", "Prefix-cache hits, in tokens found cached at admission.",
            m.prefix_cache_hits_total)
    histogram("time_to_first_token_seconds", "Time to first token.", m.ttft)
    histogram("inter_token_latency_seconds", "Time between consecutive tokens.", m.itl)
    histogram("e2e_request_latency_seconds", "End-to-end request latency.", m.e2e)
    histogram("iteration_tokens_total", "Tokens (prefill + decode) per engine step.",
              m.iteration_tokens)
    gauge("chunk_queue_length", "Prefill chunks waiting to be scheduled.",
          snapshot.chunk_queue_length)
    gauge("cache_pressure_ratio", "KV-cache usage over the high watermark; at 1 the scheduler "
          "stops admitting prefill chunks.", snapshot.kv_usage / watermark)
    gauge("bandwidth_utilization_5s_avg", "Memory bandwidth used over the peak, 5 s average.",
          snapshot.bandwidth_util_5s)
    histogram("budget_score", BUDGET_SCORE_DEFINITION, m.budget_score)
    counter("slow_queries", "Requests whose budget_score passed the slow-query threshold.",
            m.slow_queries_total)
    counter("requests_rejected", "Requests that could never be served (too long, breaker).",
            m.requests_rejected_total)
    counter("requests_failed", "Requests failed by a protection layer or their own error.",
            m.requests_failed_total)
    if health is not None:
        gauge("engine_up", "1 while the engine steps; 0 once a crash loop stopped it.",
              health.up)
        counter("engine_restarts", "Restarts of the engine after a fault in its steps.",
                health.restarts)
        counter("requests_failed_engine_down", "Requests failed or refused because the "
                "engine had stopped.", health.failed_while_down)
    return "\n".join(out) + "\n"


def _header(name: str, help_text: str, kind: str) -> list[str]:
    return [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
