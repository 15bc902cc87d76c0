"""Seed 003 §11 — symptoms against mechanisms — evaluated on live metrics.

Each rule is data: the symptom an operator sees, the mechanism the seed derives for it, the
one-line check it prescribes, and a test that reads the snapshot and recent history. A test
returns the figures that triggered it, or None when the symptom is absent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from console.tui.history import MetricHistory
from engine.snapshot import Snapshot

Figures = dict[str, str]
Test = Callable[[Snapshot, MetricHistory], Figures | None]

# How far back "recently" reaches, and the ratios that count as a heavy tail.
WINDOW_S = 30.0
TPOT_STALL_RATIO = 4.0  # TPOT p99 / p50 while prefills run: decodes waited on a prefill
STEP_JITTER_RATIO = 3.0  # step p99 / p50: step times are uneven
TTFT_BURST_RATIO = 4.0  # TTFT p99 / p50 with a queue: requests wait rather than compute
LOW_BANDWIDTH = 0.6  # below this 5 s average the memory side is not what limits
MIN_DECODES = 4  # a decode batch worth calling memory-bound
CACHE_USEFUL = 0.2  # a lifetime prefix-cache hit rate at which the cache matters
CACHE_FALL_RATIO = 0.5  # recent hit rate below this share of the lifetime rate: it fell


@dataclass(frozen=True)
class Rule:
    symptom: str
    mechanism: str
    check: str
    test: Test


@dataclass(frozen=True)
class Finding:
    symptom: str
    mechanism: str
    check: str
    figures: Figures


def _ratio(high: float | None, low: float | None) -> float | None:
    if high is None or low is None or low <= 0:
        return None
    return high / low


def _decode_stall(s: Snapshot, h: MetricHistory) -> Figures | None:
    ratio = _ratio(s.tpot_ms.p99, s.tpot_ms.p50)
    prefilling = sum(r.state == "PREFILL_CHUNKING" for r in s.requests)
    if ratio is None or ratio < TPOT_STALL_RATIO or (prefilling == 0 and s.chunk_queue_length == 0):
        return None
    return {"TPOT p50": f"{s.tpot_ms.p50:.1f} ms", "TPOT p99": f"{s.tpot_ms.p99:.1f} ms",
            "p99/p50": f"{ratio:.1f}x", "prefilling": str(prefilling)}


def _decode_memory_bound(s: Snapshot, h: MetricHistory) -> Figures | None:
    decoding = sum(r.state == "DECODING" for r in s.requests)
    prefill_share = 1.0 - s.output_tokens_per_s / s.tokens_per_s if s.tokens_per_s > 0 else 1.0
    if decoding < MIN_DECODES or s.chunk_queue_length > 0 or prefill_share > 0.2:
        return None
    return {"decoding": str(decoding), "output tok/s": f"{s.output_tokens_per_s:.0f}",
            "prefill share of tokens": f"{prefill_share:.0%}",
            "bandwidth 5 s": f"{s.bandwidth_util_5s:.0%} ({s.bandwidth_source})"}


def _preemption_recompute(s: Snapshot, h: MetricHistory) -> Figures | None:
    recent = h.window("preemptions_total", WINDOW_S)
    new = int(recent[-1] - recent[0]) if len(recent) >= 2 else 0
    high = float(s.config.get("cache_high_watermark", 1.0))
    if new <= 0 or s.kv_usage < high:
        return None
    return {f"preemptions in {WINDOW_S:.0f} s": str(new), "KV usage": f"{s.kv_usage:.0%}",
            "high watermark": f"{high:.0%}",
            "token budget": str(s.config.get("max_num_batched_tokens", "?"))}


def _step_jitter(s: Snapshot, h: MetricHistory) -> Figures | None:
    ratio = _ratio(s.step_ms.p99, s.step_ms.p50)
    if ratio is None or ratio < STEP_JITTER_RATIO:
        return None
    return {"step p50": f"{s.step_ms.p50:.1f} ms", "step p99": f"{s.step_ms.p99:.1f} ms",
            "p99/p50": f"{ratio:.1f}x"}


def _queueing(s: Snapshot, h: MetricHistory) -> Figures | None:
    ratio = _ratio(s.ttft_ms.p99, s.ttft_ms.p50)
    if ratio is None or ratio < TTFT_BURST_RATIO or s.num_waiting == 0:
        return None
    if s.bandwidth_util_5s >= LOW_BANDWIDTH:
        return None
    return {"waiting": str(s.num_waiting), "TTFT p50": f"{s.ttft_ms.p50:.0f} ms",
            "TTFT p99": f"{s.ttft_ms.p99:.0f} ms",
            "bandwidth 5 s": f"{s.bandwidth_util_5s:.0%}"}


def _kv_capacity(s: Snapshot, h: MetricHistory) -> Figures | None:
    high = float(s.config.get("cache_high_watermark", 1.0))
    if s.mode != "CACHE_PRESSURE_WAIT" and not (s.kv_usage >= high and s.num_waiting > 0):
        return None
    return {"KV usage": f"{s.kv_usage:.0%}", "blocks": f"{s.kv_blocks_used}/{s.kv_blocks_total}",
            "running": str(s.num_running), "waiting": str(s.num_waiting), "mode": s.mode}


def _prefix_cache_fall(s: Snapshot, h: MetricHistory) -> Figures | None:
    """Seed 003 §12: cached prefixes cut the prefill from T to T(1-h) tokens; a hit rate that
    falls below what this traffic had shown gives that back (evicted or changed prefixes)."""
    recent = s.prefix_cache_hit_rate
    if recent is None or not s.prefix_cache_queries_total:
        return None
    lifetime = s.prefix_cache_hits_total / s.prefix_cache_queries_total
    if lifetime < CACHE_USEFUL or recent >= CACHE_FALL_RATIO * lifetime:
        return None
    return {"hit rate recent": f"{recent:.0%}", "hit rate overall": f"{lifetime:.0%}",
            "KV usage": f"{s.kv_usage:.0%}",
            "cached blocks": f"{s.kv_blocks_cached}/{s.kv_blocks_total}"}


RULES: tuple[Rule, ...] = (
    Rule("Short chats stall for seconds when a long prompt arrives",
         "A whole prefill holds the batch and decodes are paused",
         "Line the TPOT series up with prefill start times: do they move together?",
         _decode_stall),
    Rule("Throughput rises with concurrency but the GPU stays underused",
         "Decode sits in the memory-bound region",
         "Estimate 2PB/(2P+BSk) (§3): is it far below the machine balance point?",
         _decode_memory_bound),
    Rule("Raising max_num_batched_tokens lifts throughput, then drops it",
         "Compute-bound steps plus preemption recompute eating the gain",
         "Watch the preemption count and KV usage together",
         _preemption_recompute),
    Rule("TPOT jitters and its percentiles have a heavy tail",
         "Uneven chunk lengths make uneven step times",
         "Look at the distribution of step times (not the mean): what is the spread?",
         _step_jitter),
    Rule("TTFT soars in bursts while the GPU is not busy",
         "The bottleneck is queueing, not compute",
         "Compare the waiting queue length with the time from arrival to first compute",
         _queueing),
    Rule("Concurrency will not rise: one request is fast, total throughput low",
         "KV capacity limit (B_max ≈ S_cap / S)",
         "Usable KV memory ÷ k ÷ S, against the measured concurrency ceiling",
         _kv_capacity),
    Rule("TTFT climbs back although prompts still share their prefixes",
         "Prefix-cache hits fell: prefill grows from T(1-h) back toward T tokens (§12)",
         "Hit rate against KV usage: are cached prefixes evicted under pressure, or did the "
         "shared prefix change (its format, or something varying placed before it)?",
         _prefix_cache_fall),
)


def evaluate(snapshot: Snapshot, history: MetricHistory) -> list[Finding]:
    """The symptoms present now, each with its mechanism, check and triggering figures."""
    findings = []
    for rule in RULES:
        figures = rule.test(snapshot, history)
        if figures is not None:
            findings.append(Finding(rule.symptom, rule.mechanism, rule.check, figures))
    return findings
