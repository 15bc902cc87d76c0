"""Seed 003 §11 rules on hand-built snapshots: each symptom fires on its figures and only then."""

from __future__ import annotations

import dataclasses

from console.tui.diagnosis import RULES, evaluate
from console.tui.history import MetricHistory, downsample
from engine.slo_targets import ServiceSLO
from engine.snapshot import Percentiles, RequestView, Snapshot

CONFIG = {"cache_high_watermark": 0.85, "max_num_batched_tokens": 512}


def request(i: int, state: str) -> RequestView:
    return RequestView(id=f"r{i}", tenant="t", state=state, reason="", prompt_tokens=100,
                       prefilled_tokens=50, chunks_done=1, chunks_total=2, generated_tokens=3,
                       ttft_ms=None, tpot_ms=None, budget_score=None, arrival_s=float(i))


SLO = ServiceSLO(ttft_ms=260.0)
CALM = Snapshot(ts=1.0, step=1, config=CONFIG, tokens_per_s=1000.0, output_tokens_per_s=500.0,
                ttft_ms=Percentiles(100.0, 120.0, 150.0), tpot_ms=Percentiles(10.0, 11.0, 12.0),
                step_ms=Percentiles(10.0, 11.0, 12.0), kv_usage=0.3, bandwidth_util_5s=0.8)


def symptoms(snapshot: Snapshot, history: MetricHistory | None = None) -> set[str]:
    """The keys of the rules that fire."""
    return {f.key for f in evaluate(snapshot, history or MetricHistory(), SLO)}


def test_a_calm_engine_shows_no_symptom() -> None:
    assert symptoms(CALM) == set()


def test_decode_stall_needs_a_heavy_tpot_tail_while_prefilling() -> None:
    stalled = dataclasses.replace(CALM, tpot_ms=Percentiles(10.0, 20.0, 80.0),
                                  requests=(request(0, "PREFILL_CHUNKING"),))
    found = evaluate(stalled, MetricHistory(), SLO)
    assert "decode_stall" in {f.key for f in found}
    assert found[0].figures["p99/p50"] == "8.0x"
    idle = dataclasses.replace(stalled, requests=())
    assert "decode_stall" not in symptoms(idle)


def test_memory_bound_decode() -> None:
    decoding = dataclasses.replace(CALM, requests=tuple(request(i, "DECODING") for i in range(6)),
                                   output_tokens_per_s=950.0)
    assert "decode_memory_bound" in symptoms(decoding)


def test_preemption_recompute_reads_the_history_window() -> None:
    history = MetricHistory()
    for step, preemptions in enumerate((0, 2, 5)):
        history.record(dataclasses.replace(CALM, ts=float(step), step=step,
                                           preemptions_total=preemptions))
    full = dataclasses.replace(CALM, kv_usage=0.9, preemptions_total=5)
    found = {f.key: f for f in evaluate(full, history, SLO)}
    assert found["preemption_recompute"].figures["preemptions in 30 s"] == "5"
    assert "preemption_recompute" not in symptoms(full)  # no history, no preemptions seen


def test_step_jitter_queueing_and_kv_capacity() -> None:
    jitter = dataclasses.replace(CALM, step_ms=Percentiles(10.0, 20.0, 40.0))
    assert "step_jitter" in symptoms(jitter)
    queued = dataclasses.replace(CALM, ttft_ms=Percentiles(100.0, 300.0, 900.0), num_waiting=7,
                                 bandwidth_util_5s=0.2)
    assert "queueing_bursts" in symptoms(queued)
    assert "queueing_bursts" not in symptoms(dataclasses.replace(queued, num_waiting=0))
    capped = dataclasses.replace(CALM, mode="CACHE_PRESSURE_WAIT", kv_usage=0.9, num_waiting=3)
    assert "kv_capacity" in symptoms(capped)


def test_history_keeps_one_sample_per_step_and_downsamples_keeping_peaks() -> None:
    history = MetricHistory(capacity=3)
    for step in (1, 1, 2, 3, 4):
        history.record(dataclasses.replace(CALM, step=step, kv_usage=step / 10))
    assert history.values("kv_usage") == [0.2, 0.3, 0.4]
    assert downsample([1.0, 9.0, 1.0, 1.0], 2) == [9.0, 1.0]
    assert downsample([1.0, 2.0], 5) == [1.0, 2.0]


def backlog_history(waiting: list[int], **changes: object) -> MetricHistory:
    history = MetricHistory()
    for step, count in enumerate(waiting):
        history.record(dataclasses.replace(CALM, ts=float(step), step=step, num_waiting=count,
                                           **changes))
    return history


def test_sustained_queueing_needs_a_growing_backlog_and_ttft_far_above_its_slo() -> None:
    slo = SLO.ttft_ms  # the operator's, as the header shows it: never an estimate
    slow = dataclasses.replace(CALM, num_waiting=12,
                               ttft_ms=Percentiles(3 * slo, 4 * slo, 5 * slo))
    growing = backlog_history([1, 2, 4, 6, 9, 12])
    found = {f.key: f for f in evaluate(slow, growing, SLO)}
    evidence = found["sustained_queueing"].figures
    assert evidence["waiting"] == "1 → 12" and evidence["p50/SLO"] == "3.0x"
    assert evidence["window"] == "60 s"  # the window the snapshot states
    assert "sustained_queueing" not in symptoms(slow, backlog_history([12, 9, 6, 4, 2, 1]))
    assert "sustained_queueing" not in symptoms(slow, backlog_history([5, 5, 5, 5, 5, 5]))
    near_slo = dataclasses.replace(slow, ttft_ms=Percentiles(1.5 * slo, 2 * slo, 3 * slo))
    assert "sustained_queueing" not in symptoms(near_slo, growing)
    # samples older than the window do not count
    short = dataclasses.replace(slow, stats_window_s=2.0)
    assert "sustained_queueing" not in symptoms(short, growing)


def test_every_finding_states_its_condition_and_evidence() -> None:
    queued = dataclasses.replace(CALM, ttft_ms=Percentiles(100.0, 300.0, 900.0), num_waiting=7,
                                 bandwidth_util_5s=0.2, step_ms=Percentiles(10.0, 20.0, 40.0))
    for finding in evaluate(queued, MetricHistory(), SLO):
        assert finding.condition and finding.figures
    assert {f.key for f in evaluate(queued, MetricHistory(), SLO)} >= {"step_jitter",
                                                                   "queueing_bursts"}


def test_rules_say_the_device_on_a_cpu_and_the_gpu_on_cuda() -> None:
    idle = dataclasses.replace(CALM, ttft_ms=Percentiles(100.0, 300.0, 900.0), num_waiting=7,
                               bandwidth_util_5s=0.2)
    on_cpu = {f.key: f.symptom for f in evaluate(dataclasses.replace(idle, device="cpu"),
                                                  MetricHistory(), SLO)}
    assert on_cpu["queueing_bursts"] == "TTFT soars in bursts while the device is not busy"
    on_gpu = {f.key: f.symptom for f in evaluate(dataclasses.replace(idle, device="cuda:0"),
                                                  MetricHistory(), SLO)}
    assert on_gpu["queueing_bursts"] == "TTFT soars in bursts while the GPU is not busy"
    assert all("GPU" not in rule.worded(dataclasses.replace(idle, device="cpu"))
               for rule in RULES)


def test_prefix_cache_fall_needs_a_useful_cache_that_stopped_hitting() -> None:
    fell = dataclasses.replace(CALM, prefix_cache_queries_total=10_000,
                               prefix_cache_hits_total=6_000, prefix_cache_hit_rate=0.1,
                               kv_usage=0.95, kv_blocks_cached=40, kv_blocks_total=64)
    found = {f.key: f for f in evaluate(fell, MetricHistory(), SLO)}
    assert found["prefix_cache_fall"].figures["hit rate overall"] == "60%"
    steady = dataclasses.replace(fell, prefix_cache_hit_rate=0.55)
    assert "prefix_cache_fall" not in symptoms(steady)
    never_shared = dataclasses.replace(fell, prefix_cache_hits_total=100)  # no shared prefixes
    assert "prefix_cache_fall" not in symptoms(never_shared)
    assert "prefix_cache_fall" not in symptoms(CALM)  # caching off or no lookups yet
