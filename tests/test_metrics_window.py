"""Windowed percentiles: the snapshot's TTFT, TPOT, ITL, queue wait and step
percentiles cover the last stats_window_s seconds; the lifetime histograms keep everything."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Engine, EngineConfig, SamplingParams
from engine.config import ConfigError
from engine.events import EventBus, Finished, StepComplete, TokensGenerated
from engine.ops.metrics import Metrics, _Window
from engine.snapshot import Snapshot
from engine.stats import percentiles_ms


def finished(ts: float, ttft_s: float, queue_wait_s: float, rid: str = "r") -> Finished:
    return Finished(request_id=rid, reason="length", prompt_tokens=8, generated_tokens=3,
                    ttft_s=ttft_s, e2e_s=ttft_s + 0.2, budget_score=None,
                    queue_wait_s=queue_wait_s, ts=ts)


def test_a_spike_leaves_the_window_but_stays_in_the_lifetime_histogram() -> None:
    metrics = Metrics(window_s=60.0)
    metrics.observe(finished(ts=0.0, ttft_s=128.0, queue_wait_s=120.0, rid="spike"))
    metrics.observe(StepComplete(step=1, prefill_tokens=8, decode_seqs=0, duration_s=3.0,
                                 ts=0.0))
    for i, ts in enumerate((0.0, 0.5, 1.5)):  # gaps of 0.5 s and 1 s
        metrics.observe(TokensGenerated(request_ids=("spike",), token_ids=(i,), ts=ts))
    during = metrics.latency(now=30.0)
    assert during.window_s == 60.0
    assert during.ttft.p99 == pytest.approx(128_000.0)
    assert during.queue_wait.p50 == pytest.approx(120_000.0)
    assert during.itl.p99 == pytest.approx(1000.0) and during.step.p50 == pytest.approx(3000.0)
    metrics.observe(finished(ts=90.0, ttft_s=0.1, queue_wait_s=0.02, rid="calm"))
    after = metrics.latency(now=90.0)  # the spike is 90 s old: outside the 60 s window
    assert after.ttft.p99 == pytest.approx(100.0) and after.queue_wait.p99 == pytest.approx(20.0)
    assert after.itl.p99 is None and after.step.p99 is None
    assert after.tpot.p50 == pytest.approx(100.0)  # (e2e - ttft) / (3 - 1)
    assert metrics.ttft.count == 2 and metrics.itl.count == 2  # Prometheus keeps both


def test_the_snapshot_states_its_window_and_round_trips() -> None:
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                 stats_window_s=5.0))
    engine.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_tokens=4))
    snapshot = engine.snapshot()
    assert snapshot.stats_window_s == 5.0
    assert snapshot.ttft_ms.p50 is not None and snapshot.itl_ms.p50 is not None
    assert snapshot.queue_wait_ms.p50 is not None
    assert Snapshot.from_dict(snapshot.to_dict()) == snapshot


def test_a_window_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="stats_window_s"):
        EngineConfig(stats_window_s=0).validate()


@given(values=st.lists(st.floats(0.0, 1e4, allow_nan=False), max_size=300),
       horizon=st.floats(0.0, 400.0))
@settings(max_examples=200, deadline=None)
def test_window_percentiles_are_the_nearest_rank_ones_of_the_samples_in_it(
        values: list[float], horizon: float) -> None:
    window = _Window(span_s=100.0)
    for ts, value in enumerate(values):
        window.add(float(ts), value)
    now = horizon + 100.0  # samples older than the span have left
    kept = [value for ts, value in enumerate(values) if ts >= now - 100.0]
    assert window.percentiles_ms(now) == percentiles_ms(kept)
    assert window.values(now) == kept


def test_a_request_twice_in_one_step_is_a_zero_gap_and_stopped_metrics_hear_nothing() -> None:
    bus = EventBus()
    metrics = Metrics(window_s=60.0)
    stop = metrics.subscribe_to(bus)
    bus.publish(TokensGenerated(request_ids=("a",), token_ids=(1,), ts=1.0))
    bus.publish(TokensGenerated(request_ids=("a", "b", "a"), token_ids=(2, 3, 4), ts=1.5))
    bus.drain()
    assert (metrics.itl.count, metrics.itl.total) == (2, 0.5)
    assert list(metrics.recent_itl.samples) == [0.5, 0.0]
    stop()
    bus.publish(TokensGenerated(request_ids=("a",), token_ids=(5,), ts=2.0))
    bus.drain()
    assert metrics.itl.count == 2 and metrics.generation_tokens_total == 4
