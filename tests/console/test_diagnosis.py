"""Seed 003 §11 rules on hand-built snapshots: each symptom fires on its figures and only then."""

from __future__ import annotations

import dataclasses

from console.tui.diagnosis import RULES, evaluate
from console.tui.history import MetricHistory, downsample
from engine.snapshot import Percentiles, RequestView, Snapshot

CONFIG = {"cache_high_watermark": 0.85, "max_num_batched_tokens": 512}


def request(i: int, state: str) -> RequestView:
    return RequestView(id=f"r{i}", tenant="t", state=state, reason="", prompt_tokens=100,
                       prefilled_tokens=50, chunks_done=1, chunks_total=2, generated_tokens=3,
                       ttft_ms=None, tpot_ms=None, budget_score=None, arrival_s=float(i))


CALM = Snapshot(ts=1.0, step=1, config=CONFIG, tokens_per_s=1000.0, output_tokens_per_s=500.0,
                ttft_ms=Percentiles(100.0, 120.0, 150.0), tpot_ms=Percentiles(10.0, 11.0, 12.0),
                step_ms=Percentiles(10.0, 11.0, 12.0), kv_usage=0.3, bandwidth_util_5s=0.8)


def symptoms(snapshot: Snapshot, history: MetricHistory | None = None) -> set[str]:
    return {f.symptom for f in evaluate(snapshot, history or MetricHistory())}


def test_a_calm_engine_shows_no_symptom() -> None:
    assert symptoms(CALM) == set()


def test_decode_stall_needs_a_heavy_tpot_tail_while_prefilling() -> None:
    stalled = dataclasses.replace(CALM, tpot_ms=Percentiles(10.0, 20.0, 80.0),
                                  requests=(request(0, "PREFILL_CHUNKING"),))
    found = evaluate(stalled, MetricHistory())
    assert RULES[0].symptom in {f.symptom for f in found}
    assert found[0].figures["p99/p50"] == "8.0x"
    idle = dataclasses.replace(stalled, requests=())
    assert RULES[0].symptom not in symptoms(idle)


def test_memory_bound_decode() -> None:
    decoding = dataclasses.replace(CALM, requests=tuple(request(i, "DECODING") for i in range(6)),
                                   output_tokens_per_s=950.0)
    assert RULES[1].symptom in symptoms(decoding)


def test_preemption_recompute_reads_the_history_window() -> None:
    history = MetricHistory()
    for step, preemptions in enumerate((0, 2, 5)):
        history.record(dataclasses.replace(CALM, ts=float(step), step=step,
                                           preemptions_total=preemptions))
    full = dataclasses.replace(CALM, kv_usage=0.9, preemptions_total=5)
    found = {f.symptom: f for f in evaluate(full, history)}
    assert found[RULES[2].symptom].figures["preemptions in 30 s"] == "5"
    assert RULES[2].symptom not in symptoms(full)  # no history, no preemptions seen


def test_step_jitter_queueing_and_kv_capacity() -> None:
    jitter = dataclasses.replace(CALM, step_ms=Percentiles(10.0, 20.0, 40.0))
    assert RULES[3].symptom in symptoms(jitter)
    queued = dataclasses.replace(CALM, ttft_ms=Percentiles(100.0, 300.0, 900.0), num_waiting=7,
                                 bandwidth_util_5s=0.2)
    assert RULES[4].symptom in symptoms(queued)
    assert RULES[4].symptom not in symptoms(dataclasses.replace(queued, num_waiting=0))
    capped = dataclasses.replace(CALM, mode="CACHE_PRESSURE_WAIT", kv_usage=0.9, num_waiting=3)
    assert RULES[5].symptom in symptoms(capped)


def test_history_keeps_one_sample_per_step_and_downsamples_keeping_peaks() -> None:
    history = MetricHistory(capacity=3)
    for step in (1, 1, 2, 3, 4):
        history.record(dataclasses.replace(CALM, step=step, kv_usage=step / 10))
    assert history.values("kv_usage") == [0.2, 0.3, 0.4]
    assert downsample([1.0, 9.0, 1.0, 1.0], 2) == [9.0, 1.0]
    assert downsample([1.0, 2.0], 5) == [1.0, 2.0]


def test_prefix_cache_fall_needs_a_useful_cache_that_stopped_hitting() -> None:
    rule = next(r for r in RULES if r.test.__name__ == "_prefix_cache_fall")
    fell = dataclasses.replace(CALM, prefix_cache_queries_total=10_000,
                               prefix_cache_hits_total=6_000, prefix_cache_hit_rate=0.1,
                               kv_usage=0.95, kv_blocks_cached=40, kv_blocks_total=64)
    found = {f.symptom: f for f in evaluate(fell, MetricHistory())}
    assert found[rule.symptom].figures["hit rate overall"] == "60%"
    steady = dataclasses.replace(fell, prefix_cache_hit_rate=0.55)
    assert rule.symptom not in symptoms(steady)
    never_shared = dataclasses.replace(fell, prefix_cache_hits_total=100)  # no shared prefixes
    assert rule.symptom not in symptoms(never_shared)
    assert rule.symptom not in symptoms(CALM)  # caching off or no lookups yet
