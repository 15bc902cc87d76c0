"""VllmMetricsSource: a read-only view of a vLLM server, from its Prometheus /metrics.

What vLLM exports maps onto the snapshot: running and waiting requests, KV-cache usage,
preemptions, token counters (rates from the change between two polls) and TTFT and
inter-token latency percentiles estimated from the histogram buckets, over the server's
whole life. There is no chunk queue, budget score or tuning: those panes stay empty.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from console.sources.base import Progress, SourceError
from console.sources.prometheus_text import (
    Sample,
    histogram_buckets,
    histogram_quantile,
    parse_samples,
    total,
)
from console.sources.remote import Remote, RemoteBacked
from engine.snapshot import Percentiles, Snapshot
from engine.stats import ms
from engine.store import CalibrationRecord, SlowQueryRecord

MODE = "vLLM"
# Newer vLLM names first; older releases used the later ones for the same thing.
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
TTFT = ("vllm:time_to_first_token_seconds",)


class VllmMetricsSource(RemoteBacked):
    label = "vLLM"

    def __init__(self, url: str, *, clock: Callable[[], float] = time.monotonic,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.remote = Remote(url, clock=clock, transport=transport)
        self.clock = clock
        self._last_tokens: tuple[float, float, float] | None = None  # (ts, all, generated)

    def snapshot(self) -> Snapshot:
        response = self.remote.request("GET", "/metrics")
        if response.status_code != 200:
            raise SourceError(f"{self.remote.url}/metrics answered HTTP {response.status_code}; "
                              "is this a vLLM server?")
        samples = parse_samples(response.text)
        if not any(name.startswith("vllm:") for name in samples):
            raise SourceError(f"{self.remote.url}/metrics has no vllm: metrics; "
                              "point --attach-vllm at a vLLM server")
        return self._snapshot(samples)

    def _snapshot(self, samples: dict[str, list[Sample]]) -> Snapshot:
        def count(*names: str) -> float:
            return next((v for v in (total(samples, n) for n in names) if v is not None), 0.0)

        now = self.clock()
        prompt = count("vllm:prompt_tokens_total")
        generated = count("vllm:generation_tokens_total")
        tokens_per_s, output_per_s = self._rates(now, prompt + generated, generated)
        return Snapshot(
            ts=now, model=_model_name(samples), device=self.remote.url, mode=MODE,
            mode_reason="read-only view of a vLLM server's /metrics",
            num_running=int(count("vllm:num_requests_running")),
            num_waiting=int(count("vllm:num_requests_waiting")),
            kv_usage=count(*KV_USAGE), tokens_per_s=tokens_per_s,
            output_tokens_per_s=output_per_s,
            ttft_ms=_percentiles_ms(samples, TTFT), tpot_ms=_percentiles_ms(samples, ITL),
            preemptions_total=int(count("vllm:num_preemptions_total")),
            prompt_tokens_total=int(prompt), generation_tokens_total=int(generated),
            requests_finished_total=int(count("vllm:request_success_total")),
        )

    def _rates(self, now: float, tokens: float, generated: float) -> tuple[float, float]:
        last, self._last_tokens = self._last_tokens, (now, tokens, generated)
        if last is None or now <= last[0] or tokens < last[1]:  # first poll, or a restart
            return 0.0, 0.0
        span = now - last[0]
        return (tokens - last[1]) / span, (generated - last[2]) / span

    def update_config(self, **changes: Any) -> dict[str, Any]:
        raise SourceError("a vLLM server is read-only here: change its flags and restart it")

    def pause(self) -> None:
        raise SourceError("a vLLM server cannot be paused from tokenflow")

    def resume(self) -> None:
        raise SourceError("a vLLM server cannot be paused from tokenflow")

    def slow_queries(self, limit: int = 500) -> list[SlowQueryRecord]:
        return []  # vLLM keeps no budget scores

    def slow_query(self, query_id: int) -> SlowQueryRecord:
        raise SourceError("a vLLM server keeps no slow queries")

    def recalibrate(self, progress: Progress) -> CalibrationRecord:
        raise SourceError("tokenflow cannot calibrate a vLLM server")


def _model_name(samples: dict[str, list[Sample]]) -> str:
    for found in samples.values():
        for sample in found:
            if "model_name" in sample.labels:
                return sample.labels["model_name"]
    return "vLLM"


def _percentiles_ms(samples: dict[str, list[Sample]], names: tuple[str, ...]) -> Percentiles:
    buckets = next((b for b in (histogram_buckets(samples, n) for n in names) if b), [])

    def at(q: float) -> float | None:
        return ms(histogram_quantile(buckets, q))

    return Percentiles(p50=at(0.50), p90=at(0.90), p99=at(0.99))
