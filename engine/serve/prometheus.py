"""GET /metrics: Prometheus text, vLLM's names, types and buckets under the `tokenflow_` prefix."""

from __future__ import annotations

from engine.batch import SchedulerMode
from engine.budget.plan import BUDGET_SCORE_DEFINITION
from engine.core.engine_core import EngineCore
from engine.ops.metrics import Histogram, RequestStats
from engine.serve.loop import LoopHealth
from engine.snapshot import Snapshot

PREFIX = "tokenflow_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def render_metrics(engine: EngineCore, snapshot: Snapshot, health: LoopHealth | None = None,
                   queue_full: int = 0) -> str:
    """Every family; `health` is the serve loop's (None: no supervised loop); `queue_full`
    counts requests the server refused with its queue full."""
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
    # vLLM's name: a histogram ending in _total, which promtool's lint flags, kept so a
    # dashboard reads it after one prefix substitution
    histogram("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
              m.iteration_tokens)
    out.extend(_vllm_families(engine, snapshot, labels, queue_full))
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
    out.extend(_request_families(m.requests, labels, engine.max_model_len))
    return "\n".join(out) + "\n"


def _vllm_families(engine: EngineCore, snapshot: Snapshot, labels: str,
                   queue_full: int) -> list[str]:
    """vLLM's families for what tokenflow has none of (no sleep mode, no external or
    multimodal cache): their values say so, and dashboards find every series."""
    m = engine.metrics
    out: list[str] = []

    def labelled(name: str, help_text: str, kind: str, values: dict[str, float],
                 label: str) -> None:
        out.extend(_header(name, help_text, kind))
        out.extend(f'{PREFIX}{name}{{{labels},{label}="{key}"}} {float(value)!r}'
                   for key, value in values.items())

    labelled("num_requests_waiting_by_reason", "Waiting requests by reason: capacity (for "
             "scheduling capacity) or deferred (tokenflow defers none).", "gauge",
             {"capacity": snapshot.num_waiting, "deferred": 0}, "reason")
    labelled("engine_sleep_state", "Engine sleep state; tokenflow has no sleep mode, so "
             "always awake.", "gauge",
             {"awake": 1, "weights_offloaded": 0, "discard_all": 0}, "sleep_state")
    requests = m.requests
    labelled("prompt_tokens_by_source_total", "Prompt tokens of finished requests by source.",
             "counter", {"local_compute": requests.prompt_computed_total,
                         "local_cache_hit": requests.prompt_cached_total,
                         "external_kv_transfer": 0}, "source")
    out.extend(_header("prompt_tokens_cached_total", "Cached prompt tokens of finished "
                       "requests (local + external).", "counter"))
    out.append(f"{PREFIX}prompt_tokens_cached_total{{{labels}}} "
               f"{float(requests.prompt_cached_total)!r}")
    labelled("prompt_tokens_cached_by_source_total", "Prefix-cache hit tokens by the cache "
             "tier that supplied them, counted at admission (all on the device here).",
             "counter", {"device": m.prefix_cache_hits_total, "host": 0, "p2p": 0, "disk": 0,
                         "external_unspecified": 0}, "source")
    for name, help_text in (("external_prefix_cache_queries", "External prefix-cache "
                             "queries, in tokens (tokenflow has no external cache)."),
                            ("external_prefix_cache_hits", "External prefix-cache hits, in "
                             "tokens (tokenflow has no external cache)."),
                            ("mm_cache_queries", "Multi-modal cache queries (tokenflow serves "
                             "text only)."),
                            ("mm_cache_hits", "Multi-modal cache hits (tokenflow serves text "
                             "only).")):
        out.extend(_header(f"{name}_total", help_text, "counter"))
        out.append(f"{PREFIX}{name}_total{{{labels}}} 0.0")
    labelled("admission_rejections_total", "Requests refused because the server queue was "
             "full (429), by reason.", "counter",
             {"max_num_queued_reqs": queue_full, "max_num_queued_tokens": 0}, "reason")
    config = engine.config
    info = {"block_size": config.block_size, "cache_dtype": "auto",
            "enable_prefix_caching": config.enable_prefix_caching,
            "num_gpu_blocks": engine.blocks.num_blocks}
    out.extend(_header("cache_config_info", "Information of the KV cache's configuration.",
                       "gauge"))
    out.append(f"{PREFIX}cache_config_info{{{labels},"
               + ",".join(f'{key}="{value}"' for key, value in info.items()) + "} 1.0")
    return out


def _request_families(requests: RequestStats, labels: str, max_model_len: int) -> list[str]:
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
            ("request_params_max_tokens", "Histogram of the max_tokens request parameter.",
             requests.params_max_tokens),
            ("request_max_num_generation_tokens", "Histogram of maximum number of requested "
             "generation tokens.", requests.params_max_tokens),
            ("request_prefill_kv_computed_tokens", "Histogram of new KV tokens computed during "
             "prefill (excluding cached tokens).", requests.prefill_computed)):
        # vLLM's 1-2-5 buckets up to max_model_len: the finer ones, cut (counts are cumulative)
        out.extend(_histogram(name, help_text, h, labels, limit=max_model_len))
    for name, help_text, h in (
            ("request_params_n", "Histogram of the n request parameter.", requests.params_n),
            ("request_num_preemptions", "Histogram of the number of times a request was "
             "preempted.", requests.preemptions),
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


def _histogram(name: str, help_text: str, h: Histogram, labels: str,
               limit: float | None = None) -> list[str]:
    rows = h.cumulative()
    if limit is not None:
        rows = [(le, n) for le, n in rows if le == "+Inf" or float(le) <= limit]
    return [*_header(name, help_text, "histogram"),
            *(f'{PREFIX}{name}_bucket{{{labels},le="{le}"}} {float(n)!r}' for le, n in rows),
            f"{PREFIX}{name}_count{{{labels}}} {float(rows[-1][1])!r}",
            f"{PREFIX}{name}_sum{{{labels}}} {float(h.total)!r}"]


def _header(name: str, help_text: str, kind: str) -> list[str]:
    return [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
