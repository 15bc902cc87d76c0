"""VllmMetricsSource: a read-only view of a vLLM server, from its Prometheus /metrics.

Gauges map straight onto the snapshot (running, waiting, KV usage); `cache_config_info`
gives the KV blocks and their size. Counters and histograms are differenced over the
window (prometheus_text.MetricWindow): tokens/s, TTFT and inter-token percentiles, tokens
per engine step (`iteration_tokens_total`, standing in for the chunk queue) and the bytes/s
vLLM estimates it reads (`estimated_read_bytes_per_gpu_total`, with --enable-mfu-metrics),
as a share of the device's datasheet peak. Requests and budget scores come from traces.
"""

from __future__ import annotations

import math

from console.sources.prometheus_text import Samples, first, label, percentiles
from console.sources.scraped import ScrapedSource
from engine.events import wall_offset
from engine.snapshot import Snapshot

MODE = "vLLM"
# Newer vLLM names first; older releases used the later ones for the same thing.
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
TTFT = "vllm:time_to_first_token_seconds"
STEP_TOKENS = "vllm:iteration_tokens_total"
CACHE_INFO = "vllm:cache_config_info"
PROMPT = "vllm:prompt_tokens_total"
GENERATED = "vllm:generation_tokens_total"
FINISHED = "vllm:request_success_total"
READ_BYTES = "vllm:estimated_read_bytes_per_gpu_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"


class VllmMetricsSource(ScrapedSource):
    label = "vLLM"
    prefix = "vllm:"
    flag = "--attach-vllm"
    counters = (PROMPT, GENERATED, READ_BYTES, PREFIX_HITS, PREFIX_QUERIES)
    histograms = (TTFT, *ITL, STEP_TOKENS)

    def build(self, now: float, samples: Samples) -> Snapshot:
        window = self.window

        def count(*names: str) -> float:
            return first(samples, *names) or 0.0

        def info(key: str) -> int:  # 0 is the snapshot's "unknown" for these
            value = label(samples, CACHE_INFO, key)
            try:
                number = float(value or "nan")
            except ValueError:
                return 0
            return int(number) if math.isfinite(number) and number >= 0 else 0

        blocks, block_size = info("num_gpu_blocks"), info("block_size")
        usage = count(*KV_USAGE)
        itl = next((b for b in (window.histogram(n) for n in ITL) if b), ())
        hits, queries = window.delta(PREFIX_HITS), window.delta(PREFIX_QUERIES)
        bandwidth, share, where, note = self.bandwidth(samples, READ_BYTES)
        prompt_rate, output_rate = self.rate(PROMPT), self.rate(GENERATED)
        return Snapshot(
            ts=now, wall_offset=wall_offset(), model=self.model, device=self.remote.url,
            mode=MODE,
            mode_reason="read-only view of a vLLM server's /metrics",
            step=int(count(f"{STEP_TOKENS}_count")),
            requests=self.traced_requests(), score_estimate=self.score_estimate(),
            score_note=self.score_note(),
            num_running=int(count("vllm:num_requests_running")),
            num_waiting=int(count("vllm:num_requests_waiting")),
            kv_usage=usage, kv_blocks_total=blocks, kv_blocks_used=round(usage * blocks),
            kv_block_size=block_size, kv_bytes_total=float(info("kv_cache_memory_bytes")),
            tokens_per_s=prompt_rate + output_rate, output_tokens_per_s=output_rate,
            ttft_ms=percentiles(window.histogram(TTFT), 1000.0),
            tpot_ms=percentiles(itl, 1000.0), itl_ms=percentiles(itl, 1000.0),
            step_tokens=percentiles(window.histogram(STEP_TOKENS)),
            preemptions_total=int(count("vllm:num_preemptions_total")),
            prompt_tokens_total=int(count(PROMPT)), generation_tokens_total=int(count(GENERATED)),
            requests_finished_total=int(count(FINISHED)),
            slow_queries_total=self.traced_slow_total(),
            window_s=window.seconds,
            bandwidth_util_5s=share, bandwidth_bytes_per_s=bandwidth,
            bandwidth_source=where, bandwidth_note=note,
            prefix_cache_hit_rate=hits / queries if hits is not None and queries else None,
        )
