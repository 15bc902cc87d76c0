"""SglangMetricsSource: a read-only view of an SGLang server, from its Prometheus /metrics
(started with --enable-metrics).

SGLang's gauges give running and queued requests, KV token usage, the prefix-cache hit rate
and its own generation throughput; its counters and histograms are differenced over the
window like vLLM's. It exports no per-step token histogram and no KV block layout, so the
chunk pane says so; bandwidth needs --enable-mfu-metrics, as on vLLM.
"""

from __future__ import annotations

from console.sources.prometheus_text import Samples, first, percentiles
from console.sources.scraped import ScrapedSource
from engine.events import wall_offset
from engine.snapshot import Snapshot

MODE = "SGLang"
TTFT = "sglang:time_to_first_token_seconds"
# Newer SGLang names inter-token latency like vLLM; older releases only have TPOT.
ITL = ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds")
PROMPT = "sglang:prompt_tokens_total"
GENERATED = "sglang:generation_tokens_total"
READ_BYTES = "sglang:estimated_read_bytes_per_gpu_total"
FINISHED = "sglang:num_requests_total"


class SglangMetricsSource(ScrapedSource):
    label = "SGLang"
    prefix = "sglang:"
    flag = "--attach-sglang"
    counters = (PROMPT, GENERATED, READ_BYTES)
    histograms = (TTFT, *ITL, "sglang:e2e_request_latency_seconds")

    def build(self, now: float, samples: Samples) -> Snapshot:
        window = self.window

        def count(*names: str) -> float:
            return first(samples, *names) or 0.0

        itl = next((b for b in (window.histogram(n) for n in ITL) if b), ())
        capacity = count("sglang:max_total_num_tokens")
        usage = count("sglang:token_usage")
        bandwidth, share, where, note = self.bandwidth(samples, READ_BYTES)
        prompt_rate, output_rate = self.rate(PROMPT), self.rate(GENERATED)
        return Snapshot(
            ts=now, wall_offset=wall_offset(), model=self.model, device=self.remote.url,
            mode=MODE,
            mode_reason="read-only view of an SGLang server's /metrics",
            # SGLang counts no engine steps; its token counters move whenever it works, so the
            # console's history (one sample per step) samples while it does.
            step=int(count(PROMPT) + count(GENERATED)),
            requests=self.traced_requests(), score_estimate=self.score_estimate(),
            score_note=self.score_note(),
            num_running=int(count("sglang:num_running_reqs")),
            num_waiting=int(count("sglang:num_queue_reqs")),
            kv_usage=usage,
            # SGLang's KV pool is counted in tokens: one "block" is one token.
            kv_blocks_total=int(capacity), kv_blocks_used=round(usage * capacity),
            kv_block_size=1 if capacity else 0,
            tokens_per_s=prompt_rate + output_rate, output_tokens_per_s=output_rate,
            ttft_ms=percentiles(window.histogram(TTFT), 1000.0),
            tpot_ms=percentiles(itl, 1000.0), itl_ms=percentiles(itl, 1000.0),
            prompt_tokens_total=int(count(PROMPT)), generation_tokens_total=int(count(GENERATED)),
            requests_finished_total=int(count(FINISHED)),
            slow_queries_total=self.traced_slow_total(),
            window_s=window.seconds,
            bandwidth_util_5s=share, bandwidth_bytes_per_s=bandwidth,
            bandwidth_source=where, bandwidth_note=note,
            prefix_cache_hit_rate=first(samples, "sglang:cache_hit_rate"),
        )
