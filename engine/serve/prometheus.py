"""GET /metrics: Prometheus text, vLLM's names, types and buckets under the `tokenflow_` prefix."""

from __future__ import annotations

from engine.batch import SchedulerMode
from engine.budget.plan import BUDGET_SCORE_DEFINITION
from engine.core.engine import Engine
from engine.ops.metrics import Histogram, RequestStats
from engine.serve.loop import LoopHealth
from engine.snapshot import Snapshot

PREFIX = "tokenflow_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def render_metrics(engine: Engine, snapshot: Snapshot, health: LoopHealth | None = None) -> str:
    """Every family; `health` is the serve loop's (None: no supervised loop)."""
    m = engine.metrics
    watermark = engine.config.cache_high_watermark
    labels = f'model_name="{_escape(snapshot.model)}"'
    out: list[str] = []

    def gauge(name: str, help_text: str, value: float) -> None:
        out.extend(_header(name, help_text, "gauge"))
        out.append(f"{PREFIX}{name}{{{labels}}} {float(value)!r}")

    def counter(name: str, help_text: str, value: float) -> None:
        out.extend(_header(f"{name}_total", help_text, "counter"))
        out.append(f"{PREFIX}{name}_total{{{labels}}} {float(value)!r}")

    def histogram(name: str, help_text: str, h: Histogram) -> None:
        out.extend(_histogram(name, help_text, h, labels))

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
    # vLLM's older name for the same per-token series, which its dashboards still read
    histogram("time_per_output_token_seconds", "Time between consecutive tokens.", m.itl)
    histogram("e2e_request_latency_seconds", "End-to-end request latency.", m.e2e)
    histogram("iteration_tokens", "Tokens (prefill + decode) per engine step.",
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
    gauge("slow_query_threshold", "The budget_score past which a request is a slow query.",
          engine.config.slow_query_threshold)
    gauge("cache_high_watermark", "KV-cache usage at which prefill chunks stop being admitted.",
          watermark)
    chunk = snapshot.recommended_chunk_size
    gauge("balance_chunk_tokens", "C*, the balance chunk size for the decode load now (NaN "
          "before calibration).", float("nan") if chunk is None else chunk)
    gauge("throttle_level", "Bandwidth throttle: 0 none, 1 and 2 fewer decodes, 3 prefills "
          "paused.", snapshot.throttle_level)
    gauge("prefill_paused_by_guard", "1 while a protection layer holds prefills back (the "
          "degraded path or the bandwidth throttle's last level).",
          float(engine.scheduler.prefill_paused or snapshot.throttle_level >= 3))
    gauge("engine_paused", "1 while an operator has paused the engine.", float(snapshot.paused))
    out.extend(_header("scheduler_mode", "The scheduler's mode: 1 on the current one.", "gauge"))
    out.extend(f'{PREFIX}scheduler_mode{{{labels},mode="{mode.value}"}} '
               f"{float(mode.value == snapshot.mode)!r}" for mode in SchedulerMode)
    out.extend(_request_families(m.requests, labels))
    return "\n".join(out) + "\n"


def _request_families(requests: RequestStats, labels: str) -> list[str]:
    out = _header("request_success_total", "Finished requests, by finish reason.", "counter")
    for reason in ("stop", "length", "abort", *sorted(set(requests.success)
                                                    - {"stop", "length", "abort"})):
        out.append(f'{PREFIX}request_success_total{{{labels},finished_reason="{_escape(reason)}"}}'
                   f" {float(requests.success.get(reason, 0))!r}")
    for name, help_text, h in (
            ("request_prompt_tokens", "Prompt tokens per finished request.",
             requests.prompt_tokens),
            ("request_generation_tokens", "Generated tokens per finished request.",
             requests.generation_tokens),
            ("request_queue_time_seconds", "Time from arrival to first admission.",
             requests.queue),
            ("request_prefill_time_seconds", "Time from first admission to the first token.",
             requests.prefill),
            ("request_decode_time_seconds", "Time from the first token to the end.",
             requests.decode),
            ("request_inference_time_seconds", "Time from first admission to the end.",
             requests.inference),
            ("request_time_per_output_token_seconds",
             "Mean time per output token after the first, per request.", requests.tpot)):
        out.extend(_histogram(name, help_text, h, labels))
    return out


def _histogram(name: str, help_text: str, h: Histogram, labels: str) -> list[str]:
    rows = h.cumulative()
    return [*_header(name, help_text, "histogram"),
            *(f'{PREFIX}{name}_bucket{{{labels},le="{le}"}} {float(n)!r}' for le, n in rows),
            f"{PREFIX}{name}_count{{{labels}}} {float(rows[-1][1])!r}",
            f"{PREFIX}{name}_sum{{{labels}}} {float(h.total)!r}"]


def _header(name: str, help_text: str, kind: str) -> list[str]:
    return [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
