"""Symptoms against mechanisms, evaluated on live metrics.

Each rule is data: the symptom an operator sees, the mechanism behind it, the
one-line check it prescribes, the condition it tests, and a test that reads the snapshot and
recent history. A test returns the evidence it used (the figures compared, with the window the
percentiles cover), or None when the symptom is absent. Rules speak of "the GPU" only when the
engine runs on one; elsewhere of "the device".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from console.tui.history import MetricHistory
from engine.slo_targets import ServiceSLO
from engine.snapshot import Snapshot

Figures = dict[str, str]
Test = Callable[[Snapshot, MetricHistory, ServiceSLO], Figures | None]

# How far back "recently" reaches, and the ratios that count as a heavy tail.
WINDOW_S = 30.0
TPOT_STALL_RATIO = 4.0  # TPOT p99 / p50 while prefills run: decodes waited on a prefill
STEP_JITTER_RATIO = 3.0  # step p99 / p50: step times are uneven
TTFT_BURST_RATIO = 4.0  # TTFT p99 / p50 with a queue: requests wait rather than compute
LOW_BANDWIDTH = 0.6  # below this 5 s average the memory side is not what limits
MIN_DECODES = 4  # a decode batch worth calling memory-bound
TTFT_SLO_FACTOR = 2.0  # TTFT p50 this many times its SLO is "far above" it
MIN_BACKLOG_SAMPLES = 4  # history samples of the waiting queue needed to call it a trend
CACHE_USEFUL = 0.2  # a lifetime prefix-cache hit rate at which the cache matters
CACHE_FALL_RATIO = 0.5  # recent hit rate below this share of the lifetime rate: it fell


@dataclass(frozen=True)
class Rule:
    key: str
    symptom: str  # as written for a GPU; `worded` adapts it to the engine's device
    mechanism: str
    check: str
    condition: str  # what the test compares, in words
    test: Test

    def worded(self, snapshot: Snapshot) -> str:
        return for_device(self.symptom, snapshot.device)


@dataclass(frozen=True)
class Finding:
    key: str
    symptom: str
    mechanism: str
    check: str
    condition: str
    figures: Figures  # the evidence the rule used


def for_device(text: str, device: str) -> str:
    """"the GPU" where the engine runs on CUDA, "the device" elsewhere (a CPU run)."""
    if device.startswith("cuda"):
        return text
    return text.replace("the GPU", "the device")


def _window(s: Snapshot) -> str:
    return f"{s.stats_window_s:g} s"


def _ratio(high: float | None, low: float | None) -> float | None:
    if high is None or low is None or low <= 0:
        return None
    return high / low


def _decode_stall(s: Snapshot, h: MetricHistory, slo: ServiceSLO) -> Figures | None:
    ratio = _ratio(s.tpot_ms.p99, s.tpot_ms.p50)
    prefilling = sum(r.state == "PREFILL_CHUNKING" for r in s.requests)
    if ratio is None or ratio < TPOT_STALL_RATIO or (prefilling == 0 and s.chunk_queue_length == 0):
        return None
    return {"TPOT p50": f"{s.tpot_ms.p50:.1f} ms", "TPOT p99": f"{s.tpot_ms.p99:.1f} ms",
            "p99/p50": f"{ratio:.1f}x", "prefilling": str(prefilling),
            "chunk queue": str(s.chunk_queue_length), "window": _window(s)}


def _decode_memory_bound(s: Snapshot, h: MetricHistory, slo: ServiceSLO) -> Figures | None:
    decoding = sum(r.state == "DECODING" for r in s.requests)
    prefill_share = 1.0 - s.output_tokens_per_s / s.tokens_per_s if s.tokens_per_s > 0 else 1.0
    if decoding < MIN_DECODES or s.chunk_queue_length > 0 or prefill_share > 0.2:
        return None
    return {"decoding": str(decoding), "chunk queue": str(s.chunk_queue_length),
            "output tok/s": f"{s.output_tokens_per_s:.0f}",
            "prefill share of tokens": f"{prefill_share:.0%}",
            "bandwidth 5 s": f"{s.bandwidth_util_5s:.0%} ({s.bandwidth_source})"}


def _preemption_recompute(s: Snapshot, h: MetricHistory, slo: ServiceSLO) -> Figures | None:
    recent = h.window("preemptions_total", WINDOW_S)
    new = int(recent[-1] - recent[0]) if len(recent) >= 2 else 0
    high = float(s.config.get("cache_high_watermark", 1.0))
    if new <= 0 or s.kv_usage < high:
        return None
    return {f"preemptions in {WINDOW_S:.0f} s": str(new), "KV usage": f"{s.kv_usage:.0%}",
            "high watermark": f"{high:.0%}",
            "token budget": str(s.config.get("max_num_batched_tokens", "?"))}


def _step_jitter(s: Snapshot, h: MetricHistory, slo: ServiceSLO) -> Figures | None:
    ratio = _ratio(s.step_ms.p99, s.step_ms.p50)
    if ratio is None or ratio < STEP_JITTER_RATIO:
        return None
    return {"step p50": f"{s.step_ms.p50:.1f} ms", "step p99": f"{s.step_ms.p99:.1f} ms",
            "p99/p50": f"{ratio:.1f}x", "window": _window(s)}


def _queueing(s: Snapshot, h: MetricHistory, slo: ServiceSLO) -> Figures | None:
    ratio = _ratio(s.ttft_ms.p99, s.ttft_ms.p50)
    if ratio is None or ratio < TTFT_BURST_RATIO or s.num_waiting == 0:
        return None
    if s.bandwidth_util_5s >= LOW_BANDWIDTH:
        return None
    return {"waiting": str(s.num_waiting), "TTFT p50": f"{s.ttft_ms.p50:.0f} ms",
            "TTFT p99": f"{s.ttft_ms.p99:.0f} ms", "p99/p50": f"{ratio:.1f}x",
            "bandwidth 5 s": f"{s.bandwidth_util_5s:.0%} ({s.bandwidth_source})",
            "window": _window(s)}


def _sustained_queueing(s: Snapshot, h: MetricHistory, slo: ServiceSLO) -> Figures | None:
    """Against the operator's TTFT SLO, the one every screen shows."""
    backlog = h.window("num_waiting", s.stats_window_s)
    target = slo.ttft_ms
    if len(backlog) < MIN_BACKLOG_SAMPLES or s.ttft_ms.p50 is None:
        return None
    half = len(backlog) // 2
    early, late = backlog[:half], backlog[half:]
    growing = (backlog[-1] > backlog[0]
               and sum(late) / len(late) > sum(early) / len(early))
    if not growing or s.ttft_ms.p50 < TTFT_SLO_FACTOR * target:
        return None
    return {"waiting": f"{backlog[0]:.0f} → {backlog[-1]:.0f}",
            "samples": str(len(backlog)), "TTFT p50": f"{s.ttft_ms.p50:.0f} ms",
            "TTFT SLO": f"{target:.0f} ms",
            "p50/SLO": f"{s.ttft_ms.p50 / target:.1f}x", "window": _window(s)}


def _kv_capacity(s: Snapshot, h: MetricHistory, slo: ServiceSLO) -> Figures | None:
    high = float(s.config.get("cache_high_watermark", 1.0))
    if s.mode != "CACHE_PRESSURE_WAIT" and not (s.kv_usage >= high and s.num_waiting > 0):
        return None
    return {"KV usage": f"{s.kv_usage:.0%}", "high watermark": f"{high:.0%}",
            "blocks": f"{s.kv_blocks_used}/{s.kv_blocks_total}",
            "running": str(s.num_running), "waiting": str(s.num_waiting), "mode": s.mode}


def _prefix_cache_fall(s: Snapshot, h: MetricHistory, slo: ServiceSLO) -> Figures | None:
    """Cached prefixes cut the prefill from T to T(1-h) tokens; a hit rate that
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
    Rule("decode_stall", "Short chats stall for seconds when a long prompt arrives",
         "A whole prefill holds the batch and decodes are paused",
         "Line the TPOT series up with prefill start times: do they move together?",
         f"TPOT p99/p50 at least {TPOT_STALL_RATIO:g}x while prefills run or wait",
         _decode_stall),
    Rule("decode_memory_bound", "Throughput rises with concurrency but the GPU stays underused",
         "Decode sits in the memory-bound region",
         "Estimate 2PB/(2P+BSk): is it far below the machine balance point?",
         f"at least {MIN_DECODES} decoding, no chunk queue, prefill under 20% of tokens",
         _decode_memory_bound),
    Rule("preemption_recompute", "Raising max_num_batched_tokens lifts throughput, then drops it",
         "Compute-bound steps plus preemption recompute eating the gain",
         "Watch the preemption count and KV usage together",
         f"preemptions within {WINDOW_S:g} s while KV usage is at the high watermark",
         _preemption_recompute),
    Rule("step_jitter", "TPOT jitters and its percentiles have a heavy tail",
         "Uneven chunk lengths make uneven step times",
         "Look at the distribution of step times (not the mean): what is the spread?",
         f"step p99/p50 at least {STEP_JITTER_RATIO:g}x",
         _step_jitter),
    Rule("queueing_bursts", "TTFT soars in bursts while the GPU is not busy",
         "The bottleneck is queueing, not compute",
         "Compare the waiting queue length with the time from arrival to first compute",
         f"TTFT p99/p50 at least {TTFT_BURST_RATIO:g}x with requests waiting and bandwidth "
         f"under {LOW_BANDWIDTH:.0%}",
         _queueing),
    Rule("sustained_queueing", "The waiting queue keeps growing and TTFT climbs with it",
         "Arrivals outpace what the engine serves: the backlog builds over the window",
         "Compare the arrival rate with requests finished per second; shed or add capacity",
         f"waiting queue growing over the window, TTFT p50 at least {TTFT_SLO_FACTOR:g}x "
         "its SLO",
         _sustained_queueing),
    Rule("kv_capacity", "Concurrency will not rise: one request is fast, total throughput low",
         "KV capacity limit (B_max ≈ S_cap / S)",
         "Usable KV memory ÷ k ÷ S, against the measured concurrency ceiling",
         "CACHE_PRESSURE_WAIT, or KV usage at the high watermark with requests waiting",
         _kv_capacity),
    Rule("prefix_cache_fall", "TTFT climbs back although prompts still share their prefixes",
         "Prefix-cache hits fell: prefill grows from T(1-h) back toward T tokens",
         "Hit rate against KV usage: are cached prefixes evicted under pressure, or did the "
         "shared prefix change (its format, or something varying placed before it)?",
         f"recent hit rate under {CACHE_FALL_RATIO:.0%} of a lifetime rate of at least "
         f"{CACHE_USEFUL:.0%}",
         _prefix_cache_fall),
)


def evaluate(snapshot: Snapshot, history: MetricHistory, slo: ServiceSLO) -> list[Finding]:
    """The symptoms present now, each with its mechanism, check and the evidence it used."""
    findings = []
    for rule in RULES:
        figures = rule.test(snapshot, history, slo)
        if figures is not None:
            findings.append(Finding(rule.key, rule.worded(snapshot), rule.mechanism, rule.check,
                                    rule.condition, figures))
    return findings
